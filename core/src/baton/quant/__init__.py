"""baton's quantized weights: ggml's block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K).

Weights stay as uint8 blocks ([N, row_bytes], as GGUF stores them) and run through
baton's CPU kernels (kernels/quant_gemm.cpp) or, without them, torch ops:

- ``dequantize(raw, qtype, (N, K))``: float32, bit-identical to gguf's reference.
- ``quantize(weight, "int8" | "int4")``: weight-only quantization at load (Q8_0 / Q4_1
  blocks, groups of 32), byte-compatible with gguf.
- ``QuantLinear`` / ``QuantEmbedding``: the layers over such rows.
"""

from baton.quant.formats import QType, QuantizationError, block_shape, row_bytes
from baton.quant.linear import QuantEmbedding, QuantLinear
from baton.quant.ops import dequantize
from baton.quant.quantize import quantize

__all__ = [
    "QType",
    "QuantEmbedding",
    "QuantLinear",
    "QuantizationError",
    "block_shape",
    "dequantize",
    "quantize",
    "row_bytes",
]
