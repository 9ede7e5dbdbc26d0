#!/usr/bin/env python3
"""Quantized linears (baton.quant) against float32 ones, at SmolLM2-135M's shapes.

    .venv/bin/python plugins/bench/scripts/bench_quant.py [--rows 1,4,16] [--repeats 7] [--threads 2]

Two figures, medians of ``--repeats`` runs, milliseconds:

- ``shapes``: one matrix called 20 times in a row (its weights stay in cache), per shape
  (576x576, 192x576, 1536x576, 576x1536 and the 49152x576 LM head);
- ``layers``: one pass over 30 layers' 7 linears (weights streamed from memory, as a
  decode step does), plus the head.

Implementations: ``f_linear`` (torch, fp32), ``linear_small`` (baton's fp32 small-batch
kernel), ``Q4_1`` / ``Q8_0`` / ``Q4_K`` (K = 1536 only; QuantLinear through the fused kernel up to
KERNEL_MAX_ROWS rows, else dequantize slices + GEMM), ``Q4_1_gemm`` (always the sliced
GEMM path), ``Q4_1_torch`` (no kernels), ``Q4_1_int8`` (int8 activations on ggml's rows:
linear_q8a), ``Q4_1_int8_packed`` (on repacked rows: linear_q8p, where it is built) and
``Q4_1_packed`` (exact, on repacked rows: linear_qp). Prints one JSON line per row count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from baton.kernels import loader
from baton.kernels.cpu_linear import linear_small
from baton.kernels.exact_packing import PACKED_EXACT_ENV
from baton.quant import QType, QuantLinear, quantize

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
CALLS = 20


def median_ms(fn: Callable[[], object], repeats: int, calls: int = 1) -> float:
    """Median over ``repeats`` runs of the ms one call of ``fn`` takes (``calls`` per run)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return round(statistics.median(times) * 1000, 4)


def q4_k_like(weight: torch.Tensor) -> QuantLinear:
    """A Q4_K layer of ``weight``'s shape (random blocks: the speed does not depend on values)."""
    n, k = weight.shape
    raw = torch.randint(0, 256, (n * (k // 256), 144), dtype=torch.uint8)
    raw[:, :4] = torch.tensor([0.01, 0.001]).half().view(torch.uint8)
    return QuantLinear(raw.view(n, -1), QType.Q4_K, k, n, kernels=True)


@contextlib.contextmanager
def packed_exact(on: bool) -> Iterator[None]:
    """QuantLinears built inside keep exact calls on packed rows (linear_qp) or on ggml's."""
    before = os.environ.get(PACKED_EXACT_ENV)
    os.environ[PACKED_EXACT_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[PACKED_EXACT_ENV]
        else:
            os.environ[PACKED_EXACT_ENV] = before


def implementations(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n, k = weight.shape
    raw, qtype = quantize(weight, "int4")
    with packed_exact(False):  # ggml's rows: linear_q, linear_q8a
        q41 = QuantLinear(raw, qtype, k, n, kernels=True)
        q80 = QuantLinear(*quantize(weight, "int8"), k, n, kernels=True)
        q41_gemm = QuantLinear(raw, qtype, k, n, kernels=True)
        q41_gemm.KERNEL_MAX_ROWS = 0
        q41_torch = QuantLinear(raw, qtype, k, n, kernels=False)
        q41_q8a = QuantLinear(raw, qtype, k, n, kernels=True)
        q41_q8a.int8_activations = True
        q41_q8a.packed = None
        q41_q8p = QuantLinear(raw, qtype, k, n, kernels=True)
        q41_q8p.int8_activations = True
    with packed_exact(True):
        q41_qp = QuantLinear(raw, qtype, k, n, kernels=True)
    impls = {
        "f_linear": lambda x: F.linear(x, weight),
        "linear_small": lambda x: linear_small(x, weight),
        "Q4_1": q41,
        "Q8_0": q80,
        "Q4_1_gemm": q41_gemm,
        "Q4_1_torch": q41_torch,
        "Q4_1_int8": q41_q8a,
    }
    if q41_q8p.packed is not None:
        impls["Q4_1_int8_packed"] = q41_q8p
    if q41_qp.packed is not None:
        impls["Q4_1_packed"] = q41_qp
    if k % 256 == 0:  # K-quants' blocks are 256 weights
        impls["Q4_K"] = q4_k_like(weight)
    return impls


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="implementations to leave out, comma-separated")
    ap.add_argument("--no-layers", action="store_true", help="only the per-shape figures")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not loader.load():
        raise SystemExit("baton's CPU kernels could not be built (see the warning above)")
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    shapes = {f"{n}x{k}": implementations(torch.randn(n, k) * 0.02) for n, k in SHAPES}
    layers = None
    if not args.no_layers:
        layers = [[implementations(torch.randn(n, k) * 0.02) for n, k in LAYER] for _ in range(30)]
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        out: dict = {"rows": rows, "threads": torch.get_num_threads(), "shapes": {}}
        for name, impls in shapes.items():
            x = xs[int(name.split("x")[1])]
            out["shapes"][name] = {
                impl: median_ms(lambda f=f, x=x: f(x), args.repeats, CALLS)
                for impl, f in impls.items()
                if impl not in skip
            }
        if layers is not None:
            names = [i for i in layers[0][0] if i not in skip and i != "Q4_K"]
            out["layers_30"] = {
                impl: median_ms(
                    lambda impl=impl, xs=xs: [
                        layer[j][impl](xs[LAYER[j][1]]) for layer in layers for j in range(7)
                    ],
                    args.repeats,
                )
                for impl in names
            }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
