"""Linear layers for CPU decode steps: few rows through baton's kernel, the rest through torch.

A decode step multiplies one row per request by every weight matrix, so its cost
is streaming the weights. MKL's sgemm reaches about half of the memory
bandwidth at a few rows; ``torch.ops.baton.linear_small`` (kernels/small_gemm.cpp)
reads each weight row once for up to 8 rows and is faster up to ~32 rows
(measured on SmolLM2's layers, see docs/benchmarks.md). Larger steps (prefill
chunks) keep torch's GEMM, which runs at the CPU's peak there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Rows up to which the layers' linears use the kernel (SmolLM2, 30 layers: 32 rows 63 vs 66 ms).
KERNEL_MAX_ROWS = 32
#: Rows up to which the LM head uses the kernel (49152 x 576: 16 rows 14 vs 18 ms).
HEAD_KERNEL_MAX_ROWS = 16


def linear_small(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x2d @ weight.T + bias`` through ``torch.ops.baton.linear_small`` (float32, CPU)."""
    out = x2d.new_empty(x2d.shape[0], weight.shape[0])
    torch.ops.baton.linear_small(x2d.contiguous(), weight, out)
    return out.add_(bias) if bias is not None else out


class SmallBatchLinear(torch.nn.Linear):
    """nn.Linear whose forward sends few rows (float32, CPU) to the small-batch kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if 0 < rows <= KERNEL_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
            y = linear_small(x.reshape(rows, k), self.weight.detach(), self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def use_small_batch_linears(model: torch.nn.Module, skip: torch.nn.Module | None = None) -> int:
    """Turn every plain nn.Linear of ``model`` (except ``skip``) into a SmallBatchLinear, in place.

    Only exact nn.Linear instances: a subclass may do more in its forward. The
    class swap keeps parameters, buffers and hooks. Returns how many were changed.
    """
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m is not skip:
            m.__class__ = SmallBatchLinear
            n += 1
    return n


class CpuLMHead(torch.nn.Module):
    """The LM head on CPU, shaped for the number of rows (measured, SmolLM2's 49152 x 576 head).

    With the kernels: up to HEAD_KERNEL_MAX_ROWS rows through ``linear_small``.
    Without: fewer than 8 rows as ``x @ W^T`` with ``W^T`` stored contiguous (twice as fast
    as F.linear, for 113 MB more memory). More rows: F.linear over slices of the vocabulary,
    each slice's weights still in cache for every row (64 rows: 27 ms against 36 ms in one call).
    """

    #: Rows from which the head runs slice by slice (without the kernels).
    SLICED_FROM_ROWS = 8
    #: Vocabulary rows per slice (1536 x 576 fp32 = 3.4 MiB).
    SLICE = 1536

    def __init__(self, linear: torch.nn.Linear, kernels: bool = False) -> None:
        super().__init__()
        self.weight = linear.weight  # shared (tied embeddings stay tied)
        self.bias = linear.bias
        self.out_features = linear.out_features
        self.kernels = kernels
        w_t = None if kernels else linear.weight.detach().t().contiguous()
        self.register_buffer("weight_t", w_t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if self.kernels and n <= HEAD_KERNEL_MAX_ROWS and x.dtype == torch.float32:
            y = linear_small(rows, self.weight.detach(), self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.weight_t is not None and n < self.SLICED_FROM_ROWS:
            y = torch.matmul(x, self.weight_t)
        else:
            out = rows.new_empty(n, self.out_features)
            w = self.weight.detach()
            for lo in range(0, self.out_features, self.SLICE):
                hi = min(lo + self.SLICE, self.out_features)
                torch.mm(rows, w[lo:hi].t(), out=out[:, lo:hi])
            y = out.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y
