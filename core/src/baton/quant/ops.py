"""Dequantization through baton's native kernel when it is loaded, else torch ops."""

from __future__ import annotations

import torch

from baton.kernels import loader
from baton.quant.dequant import dequantize_torch
from baton.quant.formats import QType, block_shape, check_raw


def kernels_loaded() -> bool:
    """Whether ``torch.ops.baton.linear_q`` / ``dequantize_q`` are registered in this process."""
    try:
        torch.ops.baton.linear_q  # noqa: B018  (lookup only)
    except (AttributeError, RuntimeError):
        return False
    return True


def use_kernels(kernels: bool | None) -> bool:
    """``kernels``, or when None: whether baton's kernels build and load here."""
    if kernels is None:
        return loader.load() and kernels_loaded()
    return kernels


#: The formats pack_q8p repacks (kernels/packed_q8.cpp), and its tile of output rows.
PACKED_QTYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q8_0})
PACKED_ROWS = 16


def packs_rows(qtype: QType, out_features: int) -> bool:
    """Whether ``qtype`` rows can be repacked for linear_q8p / linear_qp: the kernels are loaded
    and built with AVX-512 VNNI or AVX2, the format is one they read, the rows fill their tiles."""
    if qtype not in PACKED_QTYPES or out_features % PACKED_ROWS or not kernels_loaded():
        return False
    try:
        return bool(torch.ops.baton.q8p_kernel())
    except (AttributeError, RuntimeError):  # a build from before packed_q8.cpp
        return False


def dequantize_native(
    raw: torch.Tensor, qtype: QType, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [N, K] (into ``out`` when given) through ``torch.ops.baton.dequantize_q`` (CPU)."""
    if out is None:
        block, size = block_shape(qtype)
        out = torch.empty(raw.shape[0], raw.shape[1] // size * block)
    torch.ops.baton.dequantize_q(raw.contiguous(), int(qtype), out)
    return out


def dequantize(
    raw: torch.Tensor, qtype: QType, shape: tuple[int, int], kernels: bool | None = None
) -> torch.Tensor:
    """float32 [N, K] from uint8 [N, row_bytes] blocks of ``qtype`` (``shape`` = (N, K)).

    Bit-identical to ``gguf.quants.dequantize`` whichever path runs: the native kernel
    for CPU tensors when ``kernels`` (None: when baton's kernels load), else torch ops.
    """
    check_raw(raw, qtype, shape)
    if raw.device.type == "cpu" and use_kernels(kernels):
        return dequantize_native(raw, qtype, torch.empty(shape))
    return dequantize_torch(raw, qtype, shape)
