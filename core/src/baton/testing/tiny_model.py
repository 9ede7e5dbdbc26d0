"""Tiny random-weight models that run the whole stack in milliseconds per step.

``make_tiny_model("qwen2", dest)`` writes a Hugging Face folder: a few layers,
hidden size 64, the SmolLM2 vocabulary (49152) and the real SmolLM2 tokenizer
files (chat template included), copied from the resolved default model. So a
test can go through tokenisation, chat template, engine and detokenisation
with a model that is fast and still a real transformers architecture.

``tiny_model(arch, **overrides)`` is the cached form for tests: each distinct
model is built once per process, in a temporary folder removed at exit.
``MOE_ARCHS`` are mixture-of-experts models (4 experts per layer, 2 per token).
``tiny_model("bert")`` is an encoder (a BertModel checkpoint, no LM head): it
serves pooling requests (embeddings) only.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")
#: mixture-of-experts models: 4 experts per layer, 2 per token (expert parallel's tests)
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
#: base models without an LM head (saved as their AutoModel class): embeddings only
ENCODER_ARCHS = ("bert",)
VOCAB_SIZE = 49152
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    # Wider than transformers' 0.02: peaked attention and logits, so that a wrong
    # mask changes the tokens and greedy decoding rarely meets a near-tie.
    initializer_range=0.1,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": dict(sliding_window=None),
    "gemma": dict(hidden_act="gelu_pytorch_tanh"),
    "phi3": dict(original_max_position_embeddings=2048),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1
    ),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}


_ENCODER: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.1,
    pad_token_id=2,
)


def tiny_config(arch: str, **overrides: Any) -> Any:
    """The transformers config of a tiny ``arch`` model (``overrides`` win)."""
    from transformers import AutoConfig

    if arch in ENCODER_ARCHS:
        return AutoConfig.for_model(arch, **{**_ENCODER, **overrides})
    if arch not in ARCHS + MOE_ARCHS:
        known = ", ".join((*ARCHS, *MOE_ARCHS, *ENCODER_ARCHS))
        raise ValueError(f"unknown tiny model arch {arch!r}; choose one of {known}")
    kwargs = {**_COMMON, **_PER_ARCH[arch], **overrides}
    return AutoConfig.for_model(arch, **kwargs)


def make_tiny_model(
    arch: str = "llama",
    dest_dir: str | Path | None = None,
    seed: int = 0,
    tokenizer_dir: str | Path | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-weight ``arch`` model with the SmolLM2 tokenizer into ``dest_dir``; return it.

    ``tokenizer_dir`` defaults to the resolved default model (``smollm2-135m-instruct``,
    converted once into the model cache). ``overrides`` are config fields.
    """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    auto = AutoModel if arch in ENCODER_ARCHS else AutoModelForCausalLM
    dest = (
        Path(dest_dir)
        if dest_dir is not None
        else Path(tempfile.mkdtemp(prefix=f"baton-tiny-{arch}-"))
    )
    dest.mkdir(parents=True, exist_ok=True)
    src = Path(tokenizer_dir) if tokenizer_dir is not None else _default_tokenizer_dir()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (
            name == "generation_config.json" and (dest / name).exists()
        ):
            shutil.copy2(src / name, dest / name)
    (dest / "baton-tiny.json").write_text(
        json.dumps({"arch": arch, "seed": seed, "overrides": overrides})
    )
    return dest


def _default_tokenizer_dir() -> Path:
    from baton.model.loader import DEFAULT_ALIAS, resolve_model

    return resolve_model(DEFAULT_ALIAS)


_cache: dict[str, Path] = {}
_cache_lock = threading.Lock()
_root: Path | None = None


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """``make_tiny_model`` built once per process per (arch, seed, overrides); for test fixtures."""
    global _root
    key = json.dumps([arch, seed, overrides], sort_keys=True, default=str)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        if _root is None:
            _root = Path(tempfile.mkdtemp(prefix="baton-tiny-models-"))
            atexit.register(shutil.rmtree, _root, ignore_errors=True)
        path = make_tiny_model(arch, _root / f"m{len(_cache)}-{arch}", seed=seed, **overrides)
        _cache[key] = path
        return path
