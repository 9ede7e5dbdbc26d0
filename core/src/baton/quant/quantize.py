"""Weight-only quantization at load: ``int8`` as Q8_0 blocks, ``int4`` as Q4_1 blocks.

Groups of 32 inputs share a scale (and for int4 a minimum), stored in ggml's
layouts so the kernels that run GGUF files run these too. The rounding is gguf's
reference quantizer's (gguf.quants, as llama.cpp's ``*_ref`` functions), so the
bytes equal what gguf would write for the same float32 weights.
"""

from __future__ import annotations

import torch

from baton.quant.formats import QType, QuantizationError

MODES: dict[str, QType] = {"int8": QType.Q8_0, "int4": QType.Q4_1}
GROUP = 32
#: Weights quantized at a time (bounds the temporaries at ~10x this many floats).
_CHUNK = 1 << 20


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as C's roundf (and gguf's np_roundf)."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 2]: float32 [B, 1] as little-endian float16."""
    return v.half().view(torch.uint8)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, d.reciprocal())
    q = _roundf(blocks * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_half_bytes(d), q], dim=1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    hi = blocks.amax(dim=1, keepdim=True)
    lo = blocks.amin(dim=1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, 0.0, d.reciprocal())
    q = ((blocks - lo) * inv + 0.5).trunc().clamp(0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([_half_bytes(d), _half_bytes(lo), packed], dim=1)


def quantize(weight: torch.Tensor, mode: str) -> tuple[torch.Tensor, QType]:
    """(uint8 [N, row_bytes], its QType) for a float [N, K] weight; ``mode`` int8 or int4."""
    if mode not in MODES:
        raise QuantizationError(
            f"unknown weight quantization mode {mode!r}: use one of {', '.join(MODES)}"
        )
    if weight.dim() != 2 or weight.shape[1] % GROUP or weight.shape[1] == 0:
        raise QuantizationError(
            f"cannot quantize a weight of shape {tuple(weight.shape)} to {mode}: it must be "
            f"[out_features, in_features] with in_features a multiple of {GROUP} (the group "
            "size); keep this layer unquantized (model.quantization = none)"
        )
    qtype = MODES[mode]
    fn = _q8_0 if qtype is QType.Q8_0 else _q4_1
    n, k = weight.shape
    rows = max(1, _CHUNK // k)
    parts = []
    for n0 in range(0, n, rows):
        chunk = weight[n0 : n0 + rows].detach().to(torch.float32)
        if not bool(torch.isfinite(chunk).all()):
            raise QuantizationError(
                f"cannot quantize a weight of shape {tuple(weight.shape)} to {mode}: rows "
                f"{n0}..{n0 + len(chunk) - 1} hold NaN or infinite values; fix the checkpoint "
                "or keep this layer unquantized (model.quantization = none)"
            )
        raw = fn(chunk.reshape(-1, GROUP))
        scales = raw[:, : 2 if qtype is QType.Q8_0 else 4].contiguous().view(torch.float16)
        if not bool(torch.isfinite(scales).all()):
            raise QuantizationError(
                f"cannot quantize a weight of shape {tuple(weight.shape)} to {mode}: rows "
                f"{n0}..{n0 + len(chunk) - 1} hold values beyond float16's range (65504) that "
                "the block scales are stored in; keep this layer unquantized"
            )
        parts.append(raw.reshape(len(chunk), -1))
    return torch.cat(parts), qtype
