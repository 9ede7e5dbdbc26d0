"""A tiny Llama GGUF with every quantized type baton keeps, and its converted float32 folder.

``make_tiny_gguf(dest)`` writes ``dest/tiny.gguf`` the way llama.cpp's converter
would (attn_q / attn_k rows permuted, linears quantized, norms float32, the
embedding Q8_0 and tied to the LM head) and ``dest/converted``: the Hugging Face
folder ``convert_gguf`` would make of it (the weights dequantized with gguf-py
and un-permuted as transformers does), with the marker naming the GGUF. A model
loaded from the folder with ``model.quantization = "auto"`` then runs on the
file's blocks; with ``"none"`` on the float32 weights: the exactness reference.

The linears cycle through Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 (one stays F16,
to show a layer that is kept float). gguf-py cannot quantize to the K types, so
those blocks are random bytes with small scales: the model is random anyway.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from baton.model.gguf_cache import ConversionMarker, write_marker
from baton.testing.tiny_model import make_tiny_model

#: Dimensions that fit the K types' 256-weight blocks (every linear's in_features is 256 or 512).
TINY_GGUF_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
#: Quantized types of the linears, in turn.
LINEAR_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0")
#: A linear stored as F16 (not a type baton keeps quantized).
F16_TENSOR = "blk.2.ffn_down.weight"
#: Where each K type keeps its f16 scales (byte offsets in a block) and how large they may be.
_K_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((208,), 3e-5)}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of attn_q / attn_k rows (rotary pairs interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _random_k_blocks(qtype: Any, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    offsets, scale = _K_SCALES[qtype.name]
    for off in offsets:
        d = (rng.random((rows, cols // block)) * scale).astype(np.float16)
        raw[:, :, off : off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def make_tiny_gguf(dest: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write ``dest/tiny.gguf`` and its converted folder ``dest/converted``; return both."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType as G
    from transformers import AutoModelForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    src = make_tiny_model("llama", dest / "source", seed=seed, **TINY_GGUF_CONFIG)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(dest / "tiny.gguf"), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    state: dict[str, torch.Tensor] = {}
    n_linear = 0
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied: the file has token_embd only
            continue
        base, _, suffix = hf_name.rpartition(".")
        tname = f"{names.get_name(base)}.{suffix}"
        w = param.numpy()
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
        n_head = next((n for k, n in heads.items() if f".{k}." in tname), None)
        if n_head is not None:
            w = llama_cpp_permute(w, n_head)
        if w.ndim == 1:
            writer.add_tensor(tname, w)
            stored = w
        elif tname == F16_TENSOR:
            writer.add_tensor(tname, w.astype(np.float16))
            stored = w.astype(np.float16).astype(np.float32)
        else:
            qtype = G.Q8_0 if tname == "token_embd.weight" else G[LINEAR_TYPES[n_linear % 6]]
            n_linear += tname != "token_embd.weight"
            if qtype.name in _K_SCALES:
                raw = _random_k_blocks(qtype, *w.shape, rng)
            else:
                raw = gguf.quants.quantize(w, qtype)
            writer.add_tensor(tname, raw, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype)
        if n_head is not None:  # transformers' un-permutation: the reference's row order
            from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

            stored = LlamaTensorProcessor()._reverse_permute_weights(stored, n_head)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(state, strict=False)  # lm_head follows token_embd (tied)
    out = dest / "converted"
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    write_marker(out, ConversionMarker.of(dest / "tiny.gguf"))
    return dest / "tiny.gguf", out
