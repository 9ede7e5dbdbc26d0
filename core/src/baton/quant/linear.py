"""QuantLinear and QuantEmbedding: layers over quantized weight rows (ggml block formats).

Math: y = x @ dequantize(W).T + bias with float32 activations (bf16/fp16 inputs are
computed in float32 and cast back): exact weight-only quantization up to float
summation order. Few rows (decode steps) go through ``torch.ops.baton.linear_q``,
which decodes the blocks in registers and reads each weight byte once per call,
the output rows split over the threads; or, where ``packed_exact`` holds (CPUs with AVX-512
VNNI) and the format packs, through ``linear_qp`` on the rows repacked once
(``packed``): x split into three int8 pieces per 32 values, integer dot products, within a
float32 rounding of linear_q per block (docs/cpu-kernels.md). More rows (prefill) go through
``linear_q_tiles``: each thread dequantizes a cache-sized tile of weight rows and
runs torch's GEMM on it. A layer packed for linear_qp keeps only the packed rows (``raw`` is
None): prefill (``linear_qp_tiles``) and the embedding dequantize straight from them, with
linear_q_tiles' and dequantize_q's bits. Where AMX tiles run the packed kernels
(``q8p_path() == "amx"``) linear_qp stays ahead of the GEMM up to PACKED_AMX_MAX_ROWS rows, on the
AVX-512 VNNI loop at every row count (PACKED_VNNI_MAX_ROWS), so a layer packed for it takes it up
to there (``max_kernel_rows``). Without the kernels the same math runs on torch ops
(dequantize a slice of output rows, F.linear on it): same results, slower.

``int8_activations`` (``model.activation_quantization = "int8"``): decode-sized calls
(up to KERNEL_MAX_ROWS rows) quantize x to int8 per 32 values (``quantize_activations``)
and use integer dot products, as llama.cpp does; not exact. Where the kernels have AVX-512 VNNI
or AVX2 and the format is Q4_0, Q4_1 or Q8_0, turning it on repacks the rows once (``packed``,
kernels/packed_q8.cpp: 16 output rows per vector, two halves of 8 on AVX2) for ``linear_q8p``,
~2x faster than ``linear_q8a`` on ggml's rows; the same quantized x, so the same values up to
float summation order. ``linear_q8p`` then takes prefill-sized calls too (PACKED_INT8_MAX_ROWS), as llama.cpp
quantizes its prompt's activations; on ggml's rows prefill keeps float32 activations
(``linear_q_tiles``: faster there than ``linear_q8a`` at prefill sizes).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from baton.kernels.exact_packing import packed_exact
from baton.quant.dequant import dequantize_torch
from baton.quant.formats import QType, QuantizationError, check_raw
from baton.quant.ops import dequantize_native, packs_rows, use_kernels
from baton.quant.quantize import quantize


class QuantLinear(torch.nn.Module):
    """A linear layer whose weight stays in a quantized block format (``raw``: uint8 rows)."""

    #: Rows up to which forward runs the fused kernel (linear_q); more go through linear_q_tiles.
    KERNEL_MAX_ROWS = 16
    #: Rows up to which a packed layer runs linear_qp where AMX tiles run it: on
    #: a 2-core Xeon, 30 SmolLM2 layers of Q4_1, linear_qp took 93-97 ms at 64 rows against
    #: linear_qp_tiles' 92-164, 22-33 against 42-101 at 16 (docs/cpu-kernels.md).
    PACKED_AMX_MAX_ROWS = 64
    #: The same on the AVX-512 VNNI loop: any. On AMD Zen 4 (2 threads, 30 SmolLM2 layers of Q4_1)
    #: linear_qp took 31.0 / 40.3 / 59.2 / 77.5 / 120.9 / 305.1 / 609.3 ms at 24 / 32 / 48 / 64 /
    #: 100 / 256 / 512 rows against linear_qp_tiles' 42.9 / 56.7 / 71.8 / 86.4 / 128.9 / 305.6 /
    #: 594.6; within the limit decode_layers runs the whole step in its one parallel region, which
    #: took a 100-token exact prefill from 143 to 114 ms and a 300-token one from 441-468 to 366-406
    #: (docs/benchmarks.md). The AVX2 loop loses from 16 rows (41.9 / 39.6 ms): KERNEL_MAX_ROWS.
    PACKED_VNNI_MAX_ROWS = 1 << 30
    #: Rows up to which a packed layer with int8 activations runs linear_q8p: any. On AMD Zen 4
    #: (AVX-512 VNNI, 2 threads, 30 SmolLM2 layers of Q4_1) it took 52.5 ms at 100 rows against
    #: the float32 GEMM's (linear_qp_tiles) 127.9, 258 against 595 at 512 (docs/cpu-kernels.md).
    PACKED_INT8_MAX_ROWS = 1 << 30
    #: float32 bytes of one dequantized slice of output rows on the torch-ops path.
    SLICE_BYTES = 1 << 20

    def __init__(
        self,
        raw: torch.Tensor,
        qtype: QType,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        kernels: bool | None = None,
    ) -> None:
        super().__init__()
        qtype = QType(qtype)
        check_raw(raw, qtype, (out_features, in_features))
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise QuantizationError(
                f"bias of shape {tuple(bias.shape)} for {out_features} output features: "
                f"pass a bias of shape ({out_features},) or None"
            )
        self.qtype = qtype
        self._qtype_id = int(qtype)  # the kernels' argument, without an enum conversion per call
        self.in_features = in_features
        self.out_features = out_features
        self.kernels = use_kernels(kernels)
        #: ggml's rows as the file stores them, or None where ``packed`` holds them instead
        self.raw: torch.Tensor | None
        self.register_buffer("raw", raw.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        #: the rows repacked for linear_q8p (int8 activations) or linear_qp (exact, where
        #: packed_exact holds): not a buffer (never saved); None where the decode-sized calls
        #: read ``raw``. Packed for linear_qp, the rows are kept only here (``raw`` None):
        #: prefill (linear_qp_tiles) and the embedding read them too, with the same bits.
        self.packed: torch.Tensor | None = None
        self.int8_activations = False
        if self.packed is not None:
            self.raw = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, mode: str) -> QuantLinear:
        """``linear``'s weight quantized to ``mode`` (int8: Q8_0, int4: Q4_1), its bias kept."""
        raw, qtype = quantize(linear.weight.detach(), mode)
        return cls(raw, qtype, linear.in_features, linear.out_features, bias=linear.bias)

    @property
    def int8_activations(self) -> bool:
        """Whether decode-sized calls quantize x to int8 per 32 values (see quantize_activations).
        Setting it repacks the rows (``packed``) where a packed kernel will read them."""
        return self._int8_activations

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        self._int8_activations = bool(on)
        if self.raw is None:  # the rows live in `packed` only: it serves both
            return
        wanted = (
            self.kernels
            and self.raw.is_cpu
            and (on or packed_exact())
            and packs_rows(self.qtype, self.out_features)
        )
        if not wanted:
            self.packed = None
        elif self.packed is None:  # the same bytes for both kernels: pack once
            self.packed = torch.ops.baton.pack_q8p(self.raw, self._qtype_id)

    @property
    def weight_bytes(self) -> int:
        """Bytes held: the quantized rows (ggml's, packed, or both), plus the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        packed = 0 if self.packed is None else self.packed.numel()
        raw = 0 if self.raw is None else self.raw.numel()
        return raw + packed + bias

    @property
    def max_kernel_rows(self) -> int:
        """Rows up to which forward runs the decode-sized kernels (more: the tiled GEMM), and
        decode_layers with it: KERNEL_MAX_ROWS; on packed rows with int8 activations (linear_q8p)
        PACKED_INT8_MAX_ROWS, and for exact calls on packed rows (linear_qp) PACKED_AMX_MAX_ROWS on
        AMX tiles, PACKED_VNNI_MAX_ROWS on the AVX-512 VNNI loop."""
        if self.packed is not None and self.int8_activations:
            return self.PACKED_INT8_MAX_ROWS
        if self.packed is not None:
            exact_rows = {"amx": self.PACKED_AMX_MAX_ROWS, "vnni": self.PACKED_VNNI_MAX_ROWS}
            return max(self.KERNEL_MAX_ROWS, exact_rows.get(_packed_path(), 0))
        return self.KERNEL_MAX_ROWS

    @property
    def stored_rows(self) -> torch.Tensor:
        """The tensor holding the rows: ``raw``, or ``packed`` where the rows live only there
        (what decode_layers takes as the weight; it reads the layout from ``packed``)."""
        return self.raw if self.raw is not None else self.packed

    def ggml_rows(self) -> torch.Tensor:
        """uint8 [out_features, row bytes]: the rows as the GGUF file stores them (``raw``, or
        unpacked from ``packed``: a new tensor)."""
        if self.raw is not None:
            return self.raw
        return torch.ops.baton.unpack_q8p(self.packed, self._qtype_id)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype.name}, bias={self.bias is not None}, kernels={self.kernels}"
            + (", int8_activations=True" if self.int8_activations else "")
            + (", packed" if self.packed is not None else "")
        )

    def dequantized(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """float32 weight rows [start, stop) (all by default)."""
        if self.raw is None:
            ids = torch.arange(self.out_features)[start:stop]
            return torch.ops.baton.dequantize_q8p_rows(self.packed, self._qtype_id, ids)
        raw = self.raw[start:stop]
        shape = (raw.shape[0], self.in_features)
        if self.kernels and raw.device.type == "cpu":
            return dequantize_native(raw, self.qtype, torch.empty(shape))
        return dequantize_torch(raw, self.qtype, shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Few torch calls on the kernel path: a decode step runs this ~200 times per token.
        k = self.in_features
        if x.shape[-1] != k:
            raise QuantizationError(
                f"input of shape {tuple(x.shape)} to a QuantLinear of {k} input features: "
                f"its last dimension must be {k}"
            )
        x2 = x.reshape(-1, k)
        if x2.dtype is not torch.float32:
            x2 = x2.float()
        rows = x2.shape[0]
        bias = self.bias
        if bias is not None and bias.dtype is not torch.float32:
            bias = bias.float()  # the module was cast after it was built
        few = rows <= self.max_kernel_rows
        if self.kernels and rows and x2.is_cpu:
            if few and self.packed is not None and self.int8_activations:
                y = torch.ops.baton.linear_q8p(x2, self.packed, self._qtype_id, bias)
            elif few and self.packed is not None:
                y = torch.ops.baton.linear_qp(x2, self.packed, self._qtype_id, bias)
            elif few and self.int8_activations:
                y = torch.ops.baton.linear_q8a(x2, self.raw, self._qtype_id, bias)
            elif few:
                y = torch.ops.baton.linear_q(x2, self.raw, self._qtype_id, bias)
            elif self.raw is None:
                y = torch.ops.baton.linear_qp_tiles(x2, self.packed, self._qtype_id, bias)
            else:
                y = torch.ops.baton.linear_q_tiles(x2, self.raw, self._qtype_id, bias)
        else:
            if few and self.int8_activations:
                x2 = quantize_activations(x2)
            y = self._sliced(x2.contiguous(), bias)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype is torch.float32 else y.to(x.dtype)

    def _sliced(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x2 @ W.T + bias in torch ops, dequantizing SLICE_BYTES of output rows at a time."""
        n = self.out_features
        step = max(1, self.SLICE_BYTES // (4 * self.in_features))
        if x2.shape[0] == 0:
            return x2.new_empty(0, n)
        if step >= n:
            return F.linear(x2, self.dequantized(), bias)
        y = x2.new_empty(x2.shape[0], n)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            y[:, n0:n1] = F.linear(
                x2, self.dequantized(n0, n1), None if bias is None else bias[n0:n1]
            )
        return y


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) as linear_q8a sees it: per 32 values, d = max |x| / 127 and
    x ~ d * round(x / d) (half to even), in float32 operations the kernel also performs."""
    m, k = x.shape
    if k % ACTIVATION_BLOCK:
        raise QuantizationError(
            f"int8 activations come in blocks of {ACTIVATION_BLOCK}: K = {k} is not a multiple"
        )
    xb = x.float().reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(m, k)


#: Activations per int8 block (and its float scale) in linear_q8a.
ACTIVATION_BLOCK = 32


class QuantEmbedding(torch.nn.Module):
    """An embedding over a QuantLinear's rows (tied embedding and LM head share the bytes)."""

    def __init__(self, source: QuantLinear) -> None:
        super().__init__()
        self.source = source
        self.num_embeddings = source.out_features
        self.embedding_dim = source.in_features

    @property
    def qtype(self) -> QType:
        return self.source.qtype

    @property
    def weight_bytes(self) -> int:
        """Bytes held: the source's (shared, not counted twice by a caller that sums both)."""
        return self.source.weight_bytes

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [*ids.shape, embedding_dim]: only the gathered rows are dequantized."""
        src = self.source
        if src.raw is None:  # the rows live packed (QuantLinear.packed)
            out = torch.ops.baton.dequantize_q8p_rows(src.packed, src._qtype_id, ids.reshape(-1))
            return out.view(*ids.shape, src.in_features)
        raw = src.raw.index_select(0, ids.reshape(-1).to(torch.long))
        shape = (raw.shape[0], src.in_features)
        if src.kernels and raw.device.type == "cpu":
            out = dequantize_native(raw, src.qtype, torch.empty(shape))
        else:
            check_raw(raw, src.qtype, shape)
            out = dequantize_torch(raw, src.qtype, shape)
        return out.view(*ids.shape, src.in_features)


@functools.cache
def _packed_path() -> str:
    """The packed kernels' loop in this process: "amx", "vnni", "avx2" or "" (asked once: the
    answer is the library's and the OS's, fixed for the process)."""
    return str(torch.ops.baton.q8p_path())
