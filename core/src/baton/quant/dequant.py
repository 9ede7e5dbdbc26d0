"""Dequantization in torch ops (any device), bit-identical to gguf's numpy reference.

The same float32 arithmetic as gguf.quants (scale times q, then the offset, never
fused), so a row dequantized here, by the native ``dequantize_q`` or by gguf
equals the others exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from baton.quant.formats import QType, block_shape, check_raw


def _f16(b: torch.Tensor) -> torch.Tensor:
    """float32 [B, 1] from the little-endian float16 held in uint8 [B, 2]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, n, 32] from [B, n, 16] bytes: each run's low nibbles, then its high nibbles."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return d * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 groups' scales d * sc and mins dmin * m ([B, 8, 1]) of Q4_K / Q5_K blocks."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16]
    lo, mid, hi = s[:, :4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """[B, 8, 32] nibbles of Q4_K / Q5_K's 128 bytes: group 2j low, 2j+1 high of bytes 32j.."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, m = _k_scales(b)
    return (d * _k_low(b[:, 16:]).float() - m).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, m = _k_scales(b)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = ((b[:, 16:48].unsqueeze(1) >> shifts) & 1) << 4
    return (d * (_k_low(b[:, 48:]) | high).float() - m).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = (low | (high << 4)).to(torch.int16) - 32
    d = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
    return (d.unsqueeze(-1) * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


_BLOCK_FN: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q8_0: _q8_0,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
}


def dequantize_torch(raw: torch.Tensor, qtype: QType, shape: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K] from uint8 [N, row_bytes] blocks of ``qtype``, in torch ops."""
    check_raw(raw, qtype, shape)
    n, k = shape
    _, size = block_shape(qtype)
    blocks = raw.contiguous().view(-1, size)
    return _BLOCK_FN[QType(qtype)](blocks).reshape(n, k)
