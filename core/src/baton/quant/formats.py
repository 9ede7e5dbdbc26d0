"""ggml's block formats that baton keeps quantized: type ids, block sizes, row sizes.

Each weight row of K inputs is K / block elements blocks stored back to back;
the layouts are ggml's (ggml-common.h), as GGUF files store them:

- Q4_0 (32 weights, 18 bytes): scale d (f16), 16 bytes of nibbles; w = d * (q - 8).
- Q4_1 (32, 20): d, min m (f16), 16 bytes of nibbles; w = d * q + m.
- Q8_0 (32, 34): d (f16), 32 int8; w = d * q.
- Q4_K (256, 144): d, dmin (f16), 12 bytes of 6-bit scales and mins for 8 groups of 32,
  128 bytes of nibbles; w = d * scale * q - dmin * min.
- Q5_K (256, 176): as Q4_K plus 32 bytes holding each weight's fifth bit.
- Q6_K (256, 210): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per
  16 weights), d (f16); w = d * scale * (q - 32).

In the nibble formats byte i of a 32-weight run holds weight i in its low nibble and
weight i + 16 in its high one.
"""

from __future__ import annotations

import enum

from baton.errors import BatonError


class QuantizationError(BatonError, ValueError):
    """A weight cannot be quantized, or quantized bytes do not fit their type and shape."""


class QType(enum.IntEnum):
    """The quantized types baton runs, numbered as ggml numbers them (GGMLQuantizationType)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


_BLOCKS: dict[QType, tuple[int, int]] = {
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q8_0: (32, 34),
    QType.Q4_K: (256, 144),
    QType.Q5_K: (256, 176),
    QType.Q6_K: (256, 210),
}


def block_shape(qtype: QType) -> tuple[int, int]:
    """(weights per block, bytes per block) of ``qtype``."""
    return _BLOCKS[QType(qtype)]


def row_bytes(qtype: QType, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` inputs; QuantizationError if blocks do not fit."""
    block, size = block_shape(qtype)
    if in_features <= 0 or in_features % block:
        raise QuantizationError(
            f"{QType(qtype).name} needs rows of a multiple of {block} weights, got "
            f"{in_features}: keep this layer unquantized (model.quantization = none) or use "
            "a type with a smaller block"
        )
    return in_features // block * size


def check_raw(raw: object, qtype: QType, shape: tuple[int, int]) -> None:
    """Raise QuantizationError unless ``raw`` is uint8 [N, row_bytes] for ``shape`` = (N, K)."""
    import torch

    n, k = shape
    want = (n, row_bytes(qtype, k))
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or tuple(raw.shape) != want:
        got = (
            f"{raw.dtype} {tuple(raw.shape)}"
            if isinstance(raw, torch.Tensor)
            else type(raw).__name__
        )
        raise QuantizationError(
            f"{QType(qtype).name} weights of shape {tuple(shape)} are uint8 {want}, got {got}: "
            "pass the tensor's raw bytes, one row per output feature"
        )
