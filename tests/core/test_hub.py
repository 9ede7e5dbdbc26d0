"""Models by Hugging Face Hub id: the local Hub cache, downloads, HF_HUB_OFFLINE (issue 16 item 5).

Downloads go through the real huggingface_hub client over real HTTP to a stand-in Hub on
127.0.0.1 (tests/core/fake_hub.py) serving the tiny test model.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest

from baton import LLM, SamplingParams
from baton.errors import ModelLoadError
from baton.model.loader import resolve_model
from baton.testing.tiny_model import tiny_model

from .fake_hub import COMMIT, FakeHub

REPO = "acme/tiny-llama"


@pytest.fixture
def model() -> Path:
    return tiny_model("llama")


@pytest.fixture
def hub(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A stand-in Hub serving the tiny model as REPO; an empty Hub cache; downloads allowed."""
    fake = FakeHub({REPO: model})
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    # huggingface_hub read HF_HUB_OFFLINE (tests/conftest.py: 1) once, at its import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield fake
    fake.close()


def lay_out_as_hub_cache(folder: Path, cache: Path, repo: str, ref: str = "main") -> Path:
    """``folder`` copied into ``cache`` as huggingface_hub lays a repo out (blobs are plain
    files here: snapshots may hold copies instead of links)."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / COMMIT
    shutil.copytree(folder, snap)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / ref).write_text(COMMIT)
    return snap


def greedy(model: str, **kw: object) -> list[list[int]]:
    with LLM(model=model, max_model_len=64, **kw) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6, 7]}],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_hub_id_in_the_local_cache_loads_offline(model, tmp_path, monkeypatch):
    cache = tmp_path / "hub-cache"
    snap = lay_out_as_hub_cache(model, cache, REPO)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO) == snap
    assert greedy(REPO) == greedy(str(model))


def test_hf_home_locates_the_cache_too(model, tmp_path, monkeypatch):
    snap = lay_out_as_hub_cache(model, tmp_path / "home" / "hub", REPO)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO) == snap


def test_a_missing_hub_id_is_downloaded_when_allowed(hub, model, tmp_path, monkeypatch):
    folder = resolve_model(REPO)
    assert folder.is_relative_to(tmp_path / "hub-cache") and folder.name == COMMIT
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in model.iterdir())
    assert (folder / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert any(r.endswith("/model.safetensors") for r in hub.requests)
    # now cached: found with the network forbidden, and it runs as the original folder does
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(hub.requests)
    assert resolve_model(REPO) == folder
    assert greedy(REPO) == greedy(str(model)) and len(hub.requests) == n


def test_a_revision_is_downloaded_under_its_ref(hub, tmp_path):
    folder = resolve_model(REPO, revision="v1.0")
    refs = tmp_path / "hub-cache" / f"models--{REPO.replace('/', '--')}" / "refs"
    assert (refs / "v1.0").read_text() == COMMIT and (folder / "config.json").is_file()


def test_offline_says_how_to_get_a_missing_model(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        resolve_model(REPO)
    msg = str(e.value)
    assert REPO in msg and "HF_HUB_OFFLINE=1 forbids" in msg and f"hf download {REPO}" in msg
    assert not any("resolve" in r for r in hub.requests)


def test_model_download_false_forbids_downloading(hub):
    with pytest.raises(ModelLoadError, match=r"model\.download = false"):
        LLM(model=REPO, download=False)
    assert not any("resolve" in r for r in hub.requests)


def test_a_repository_the_hub_does_not_have_names_the_id(hub):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("acme/no-such-model")
    msg = str(e.value)
    assert "'acme/no-such-model'" in msg and "failed" in msg and "HF_TOKEN" in msg


@pytest.mark.parametrize("name", ["just-a-name", "a/b/c", "../etc/passwd"])
def test_names_that_are_no_hub_id_say_what_a_model_can_be(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="built-in alias"):
        resolve_model(name)
