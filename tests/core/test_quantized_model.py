"""model.quantization at load: which modules are replaced, what they hold, what they compute.

A tiny Llama GGUF (baton.testing.tiny_gguf: every type baton keeps, one F16
linear, Q8_0 embedding tied to the LM head) and its converted float32 folder;
the tiny random safetensors models for int8 / int4. Greedy parity through the
whole engine is in tests/e2e/test_quantized_parity.py.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.kernels.exact_packing import packed_exact
from baton.model.gguf_cache import MARKER
from baton.model.quantization import _why_dequantized
from baton.model.weights import load_model, weight_bytes
from baton.protocol import KVCacheConfig
from baton.quant import QType, QuantEmbedding, QuantLinear, dequantize, quantize
from baton.quant.ops import packs_rows
from baton.testing.tiny_gguf import F16_TENSOR, make_tiny_gguf
from baton.testing.tiny_model import tiny_model
from baton.worker.model_runner import ModelRunner
from baton.worker.worker import runner_settings

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("BATON_") and k != "BATON_CACHE_DIR":
            monkeypatch.delenv(k)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(gguf file, converted folder)."""
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def load(path, quantization: str, **overrides) -> torch.nn.Module:
    cfg = BatonConfig.load(model=str(path), **{"model.quantization": quantization}, **overrides)
    return load_model(cfg.model, cfg.executor, CPU)


def quant_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        n: m
        for n, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, QuantLinear | QuantEmbedding)
    }


# --------------------------------------------------------------------------- config


def test_the_setting_and_its_refusals(monkeypatch):
    assert BatonConfig.load().model.quantization == "auto"
    monkeypatch.setenv("BATON_MODEL__QUANTIZATION", "int4")
    assert BatonConfig.load().model.quantization == "int4"
    monkeypatch.delenv("BATON_MODEL__QUANTIZATION")
    with pytest.raises(ConfigError, match=r"model.quantization: .*'int8' or 'int4' \(got 'q4'\)"):
        BatonConfig.load(**{"model.quantization": "q4"})
    with pytest.raises(ConfigError, match=r"cannot take dtype='bfloat16'.*model\.dtype"):
        BatonConfig.load(**{"model.quantization": "int4", "model.dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2.*tensor_parallel_size = 1"):
        BatonConfig.load(**{"model.quantization": "int8"}, tensor_parallel_size=2)
    # auto stays valid with any dtype and parallelism: it falls back to dequantized weights
    BatonConfig.load(**{"model.dtype": "bfloat16"}, tensor_parallel_size=2)


def test_activation_quantization_setting(tiny_gguf, caplog):
    assert BatonConfig.load().model.activation_quantization == "none"
    with pytest.raises(ConfigError, match=r"quantization='none' makes none.*'auto', 'int8'"):
        BatonConfig.load(**{"model.quantization": "none", "model.activation_quantization": "int8"})
    _, folder = tiny_gguf
    model = load(folder, "auto", **{"model.activation_quantization": "int8"})
    linears = [m for m in quant_modules(model).values() if isinstance(m, QuantLinear)]
    assert linears and all(m.int8_activations for m in linears)
    plain = quant_modules(load(folder, "auto")).values()
    assert not any(m.int8_activations for m in plain if isinstance(m, QuantLinear))
    with caplog.at_level(logging.WARNING):  # a safetensors model under auto: nothing quantized
        load(tiny_model("llama"), "auto", **{"model.activation_quantization": "int8"})
    assert "has no quantized layer to apply to" in caplog.text


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi"],
        ["bench", "latency"],
        ["bench", "throughput"],
        ["serve"],
    ],
)
def test_every_engine_command_takes_it_with_set(argv):
    from baton.cli.main import build_parser, engine_overrides

    args = build_parser().parse_args([*argv, "--set", "model.quantization=int4"])
    assert BatonConfig.load(**engine_overrides(args)).model.quantization == "int4"


def test_auto_says_why_a_gguf_stays_dequantized():
    cfg = BatonConfig.load()
    assert _why_dequantized(cfg.executor, CPU, torch.float32) == ""
    assert "float32" in _why_dequantized(cfg.executor, CPU, torch.bfloat16)
    assert "CPU" in _why_dequantized(cfg.executor, torch.device("cuda"), torch.float32)
    assert "tensor parallel" in _why_dequantized(
        cfg.replace(tensor_parallel_size=2).executor, CPU, torch.float32
    )


# --------------------------------------------------------------------------- GGUF, auto


def test_the_gguf_index_reads_what_gguf_py_reads(tiny_gguf):
    import numpy as np
    from gguf import GGUFReader

    from baton.model.gguf_tensors import GGUFTensors

    path, _ = tiny_gguf
    ours = GGUFTensors(path)
    try:
        assert ours.architecture == "llama"
        for t in GGUFReader(path).tensors:
            assert t.name in ours and ours.type_id(t.name) == int(t.tensor_type)
            rt = ours.read(t.name)
            assert rt.shape[1] == int(t.shape[0])
            want = np.ascontiguousarray(t.data).view(np.uint8).reshape(rt.raw.shape)
            assert np.array_equal(rt.raw.numpy(), want), t.name
    finally:
        ours.close()


def test_auto_keeps_every_quantized_tensor_of_a_gguf(tiny_gguf):
    from gguf import GGUFReader

    path, folder = tiny_gguf
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    model = load(folder, "auto")
    quant = quant_modules(model)
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert linears == ["model.layers.2.mlp.down_proj"]  # F16 in the file: kept as loaded
    assert types[F16_TENSOR] == "F16"
    q = quant["model.layers.0.self_attn.q_proj"]
    assert (q.qtype.name, q.in_features, q.out_features) == (
        types["blk.0.attn_q.weight"],
        256,
        256,
    )
    assert {m.qtype for m in quant.values() if isinstance(m, QuantLinear)} == set(QType)
    # the Q8_0 embedding serves as the tied LM head: one copy of its blocks
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, QuantEmbedding) and isinstance(head, QuantLinear)
    assert head.qtype == QType.Q8_0 and emb.source is head
    lins = [m for m in quant.values() if isinstance(m, QuantLinear)]
    _check_packing(lins)
    raw_bytes = sum(m.ggml_rows().numel() for m in lins)
    assert sum(m.weight_bytes for m in lins) == raw_bytes
    unique = {id(m): m for m in lins}.values()  # the tied head once
    # the model's count sees packed rows too (and the float tensors)
    assert weight_bytes(model) > sum(m.ggml_rows().numel() for m in unique)


def test_auto_layers_compute_what_the_converted_weights_do(tiny_gguf):
    _, folder = tiny_gguf
    model, ref = load(folder, "auto"), load(folder, "none")
    assert not quant_modules(ref)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for name, want_mod in ref.named_modules(remove_duplicate=False):
        m = model.get_submodule(name)
        if isinstance(m, QuantEmbedding):
            ids = torch.tensor([[0, 5, 49151, 1234]])
            torch.testing.assert_close(m(ids), want_mod(ids), rtol=0, atol=0)
        elif isinstance(m, QuantLinear):
            for rows in (1, 3, 40):  # decode-shaped and prefill-shaped
                x = torch.randn(1, rows, m.in_features, generator=g)
                torch.testing.assert_close(m(x), want_mod(x), rtol=1e-4, atol=1e-4)
        else:
            continue
        checked += 1
    assert checked == 3 * 7 - 1 + 2  # every linear but the F16 one, the embedding, the head


def test_a_wrong_row_order_keeps_the_layer_float(tiny_gguf, monkeypatch, caplog):
    from baton.model import gguf_tensors

    _, folder = tiny_gguf
    monkeypatch.setattr(gguf_tensors, "PERMUTED_QK_ARCHS", frozenset())  # "forget" the permutation
    with caplog.at_level(logging.WARNING):
        model = load(folder, "auto")
    assert type(model.get_submodule("model.layers.0.self_attn.q_proj")) is torch.nn.Linear
    assert type(model.get_submodule("model.layers.0.self_attn.k_proj")) is torch.nn.Linear
    assert isinstance(model.get_submodule("model.layers.0.self_attn.v_proj"), QuantLinear)
    assert "differ from the converted weights" in caplog.text


def test_a_changed_source_file_keeps_the_conversion(tiny_gguf, tmp_path, caplog):
    import shutil

    _, folder = tiny_gguf
    copy = tmp_path / "converted"
    shutil.copytree(folder, copy)
    marker = json.loads((copy / MARKER).read_text())
    marker["mtime"] -= 10
    (copy / MARKER).write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING):
        model = load(copy, "auto")
    assert not quant_modules(model)
    assert "changed since it was converted" in caplog.text


def test_none_and_non_float32_dtypes_load_the_gguf_dequantized(tiny_gguf, caplog):
    _, folder = tiny_gguf
    assert not quant_modules(load(folder, "none"))
    with caplog.at_level(logging.INFO):
        model = load(folder, "auto", **{"model.dtype": "bfloat16"})
    assert not quant_modules(model)
    assert "compute in float32, not bfloat16, so every weight is dequantized" in caplog.text


def test_auto_runs_a_safetensors_model_as_stored():
    assert not quant_modules(load(tiny_model("llama"), "auto"))


# --------------------------------------------------------------------------- int8 / int4


@pytest.mark.parametrize(("mode", "qtype"), [("int8", QType.Q8_0), ("int4", QType.Q4_1)])
def test_int8_int4_quantize_every_linear_and_the_tied_embedding(mode, qtype):
    path = tiny_model("llama")
    model, ref = load(path, mode), load(path, "none")
    assert not [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    quant = quant_modules(model)
    linears = [n for n, m in ref.named_modules() if type(m) is torch.nn.Linear]
    assert set(linears) <= set(quant)
    assert {m.qtype for m in quant.values() if isinstance(m, QuantLinear)} == {qtype}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, QuantEmbedding) and emb.source is head  # tied: quantized once
    # bytes: one block per 32 weights, every weight matrix once
    block_bytes = {QType.Q8_0: 34, QType.Q4_1: 20}[qtype]
    weights = sum(ref.get_submodule(n).weight.numel() for n in linears)  # lm_head is the embedding
    unique = {id(m): m for m in quant.values() if isinstance(m, QuantLinear)}
    _check_packing(list(unique.values()))
    assert sum(m.weight_bytes for m in unique.values()) == weights // 32 * block_bytes
    # each layer computes x @ dequantize(quantize(W)).T
    g = torch.Generator().manual_seed(0)
    for name in linears:
        w = ref.get_submodule(name).weight.detach()
        raw, qt = quantize(w, mode)
        x = torch.randn(2, w.shape[1], generator=g)
        want = x @ dequantize(raw, qt, tuple(w.shape)).T
        torch.testing.assert_close(model.get_submodule(name)(x), want, rtol=1e-4, atol=1e-4)


def test_int8_keeps_a_layer_whose_width_is_not_a_multiple_of_32(caplog):
    path = tiny_model("llama", intermediate_size=100)  # down_proj: 100 inputs
    with caplog.at_level(logging.INFO):
        model = load(path, "int8")
    assert type(model.get_submodule("model.layers.0.mlp.down_proj")) is torch.nn.Linear
    assert isinstance(model.get_submodule("model.layers.0.mlp.up_proj"), QuantLinear)
    assert "in_features 100 is not a multiple of 32" in caplog.text


# --------------------------------------------------------------------------- the runner


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_the_runner_keeps_quantized_layers_and_head(tiny_gguf, cpu_kernels):
    _, folder = tiny_gguf
    cfg = BatonConfig.load(
        model=str(folder), max_num_seqs=4, max_num_batched_tokens=64, cpu_kernels=cpu_kernels
    )
    runner = ModelRunner(runner_settings(cfg), CPU)
    runner.load_model()
    runner.initialize_kv_cache(KVCacheConfig(num_blocks=16, block_size=16))  # warm-up runs
    assert runner.dtype == torch.float32 and runner.vocab_size == 49152
    head = runner.model.get_output_embeddings()
    assert type(head) is QuantLinear  # not wrapped again as a CpuLMHead
    q = runner.model.get_submodule("model.layers.1.mlp.up_proj")
    assert type(q) is QuantLinear  # not a SmallBatchLinear
    if not cpu_kernels:
        assert all(
            m.kernels is False
            for m in quant_modules(runner.model).values()
            if isinstance(m, QuantLinear)
        )
    kept = runner.model.get_submodule("model.layers.2.mlp.down_proj")
    assert type(kept).__name__ == ("SmallBatchLinear" if runner.kernels else "Linear")


def _check_packing(lins: list[QuantLinear]) -> None:
    """Exactly the layers packed_exact packs keep their rows packed (linear_qp's layout), and
    only there (``raw`` None): one copy of every weight either way."""
    for m in lins:
        packs = packed_exact() and packs_rows(m.qtype, m.out_features)
        assert (m.packed is not None) == packs and (m.raw is None) == packs
