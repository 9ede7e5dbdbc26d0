#!/usr/bin/env python3
"""SmolLM2-shaped linears at decode row counts: torch's F.linear against baton's small-batch kernel.

    .venv/bin/python plugins/bench/scripts/bench_linear.py [--rows 1,2,3,4,8,16,32,64] [--repeats 5]

Random weights of SmolLM2-135M's shapes (30 layers x q/k/v/o/gate/up/down, and the
49152 x 576 LM head); prints one JSON line per row count with the median ms of
one pass over all 30 layers and of the LM head, for each implementation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from baton.kernels import loader
from baton.kernels.cpu_linear import linear_small

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default="1,2,3,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not loader.load():
        raise SystemExit("baton's CPU kernels could not be built (see the warning above)")
    torch.manual_seed(0)
    layers = [[torch.randn(*s) for s in SHAPES] for _ in range(30)]
    head = torch.randn(49152, 576)
    for m in map(int, args.rows.split(",")):
        print(json.dumps(measure(m, layers, head, args.repeats)), flush=True)


def measure(m: int, layers: list[list[torch.Tensor]], head: torch.Tensor, repeats: int) -> dict:
    """Median ms of the 30 layers' linears and of the LM head at ``m`` rows, torch vs kernel."""
    x, xd = torch.randn(m, 576), torch.randn(m, 1536)

    def layers_with(f):
        return lambda: [f(xd if w.shape[1] == 1536 else x, w) for layer in layers for w in layer]

    return {
        "rows": m,
        "layers_ms": {
            "torch": median_ms(layers_with(F.linear), repeats),
            "kernel": median_ms(layers_with(linear_small), repeats),
        },
        "lm_head_ms": {
            "torch": median_ms(lambda: F.linear(x, head), repeats),
            "kernel": median_ms(lambda: linear_small(x, head), repeats),
        },
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    main()
