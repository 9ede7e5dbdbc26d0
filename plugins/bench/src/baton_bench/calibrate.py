"""Measure the cost model (``baton.sched.cost_model``) on this machine.

``calibrate`` runs probe batches (a few prompt lengths and batch sizes) through
the real Scheduler and the configured executor with the real model, times every
step (schedule + forward + update), takes the median time of each step shape
(prefill tokens, decode tokens) over ``repeats`` rounds, so a busy neighbour's
spikes do not bend the fit, and fits the four coefficients by non-negative least
squares on relative error. ``baton bench scheduler --calibrate --cost-model-out
FILE`` writes the JSON (``baton_bench.cost_files``).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from typing import Any

import numpy as np

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.sched.cost_model import CostModel, step_features
from baton_bench.common import CpuMonitor

#: Probe batches for calibration: (requests, prompt tokens, output tokens). With the default
#: budget of 2048 they give prefill steps of 48 to 2048 tokens and decode steps of 1 to 64 requests.
PROBES = ((1, 48, 16), (4, 96, 12), (16, 128, 10), (64, 64, 8))
WARMUP = (2, 40, 4)


# ----------------------------------------------------------------------------- fitting

Sample = tuple[tuple[int, int, int], float]


def aggregate(samples: list[Sample]) -> list[Sample]:
    """One sample per step shape (prefill, decode): the median time and the median attention pairs."""
    groups: dict[tuple[int, int], list[Sample]] = {}
    for f, t in samples:
        groups.setdefault((f[0], f[1]), []).append((f, t))
    return [
        ((p, d, int(statistics.median(f[2] for f, _ in g))), statistics.median(t for _, t in g))
        for (p, d), g in sorted(groups.items())
    ]


def fit(samples: list[Sample]) -> tuple[CostModel, dict[str, float]]:
    """Non-negative least squares of step time on (1, prefill, decode, pairs), on relative error."""
    x = np.array([[1.0, *f] for f, _ in samples])
    y = np.array([t for _, t in samples])
    w = 1.0 / y
    best: tuple[float, Any] | None = None
    for k in range(1, 5):  # every subset of active coefficients: 15 tiny solves, exact NNLS
        for cols in itertools.combinations(range(4), k):
            a = x[:, cols] * w[:, None]
            coef, *_ = np.linalg.lstsq(a, y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[list(cols)] = coef
            err = float(np.sum(((x @ full - y) * w) ** 2))
            if best is None or err < best[0]:
                best = (err, full)
    if best is None:
        raise ValueError("no non-negative fit of the step times")
    coef = best[1]
    rel = np.abs(x @ coef - y) / y
    model = CostModel(
        step_overhead_s=float(coef[0]),
        prefill_s_per_token=float(coef[1]),
        decode_s_per_token=float(coef[2]),
        attention_s_per_token_pair=float(coef[3]),
    )
    return model, {
        "steps": len(samples),
        "rel_err_median": float(np.median(rel)),
        "rel_err_max": float(rel.max()),
    }


# ----------------------------------------------------------------------------- calibration


def _probe_requests(
    tag: str, n: int, prompt_len: int, max_tokens: int, vocab: int, rng: random.Random
) -> list[Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        Request(
            f"{tag}-{i}",
            [rng.randrange(3, vocab) for _ in range(prompt_len)],
            params,
            eos_token_id=None,
        )
        for i in range(n)
    ]


def measure_steps(core: Any, requests: list[Any]) -> list[Sample]:
    """Serve ``requests`` on an EngineCore step by step; (features, seconds) of every step."""
    sched, executor = core.scheduler, core.executor
    for r in requests:
        sched.add_request(r)
    out = []
    perf = time.perf_counter
    while sched.has_unfinished_requests():
        t0 = perf()
        so = sched.schedule()
        features = step_features(sched.requests, so.num_scheduled_tokens)
        result = executor.execute_model(so)
        if result is None:
            result = executor.sample_tokens(None)
        sched.update_from_output(so, result)
        out.append((features, perf() - t0))
    return out


def calibrate(
    config: BatonConfig,
    probes: tuple[tuple[int, int, int], ...] = PROBES,
    seed: int = 0,
    repeats: int = 3,
) -> CostModel:
    """Measure the cost model with the configured executor and model (see the module docstring)."""
    rng = random.Random(seed)
    core = EngineCore(config)
    try:
        vocab = core.info.vocab_size
        measure_steps(core, _probe_requests("warmup", *WARMUP, vocab, rng))
        samples: list[Sample] = []
        t0 = time.perf_counter()
        with CpuMonitor() as cpu:
            for k in range(repeats):
                for i, (n, prompt_len, max_tokens) in enumerate(probes):
                    reqs = _probe_requests(f"probe{k}-{i}", n, prompt_len, max_tokens, vocab, rng)
                    samples += measure_steps(core, reqs)
        wall = time.perf_counter() - t0
        num_blocks = core.num_blocks
    finally:
        core.shutdown()
    model, quality = fit(aggregate(samples))
    quality["raw_steps"] = len(samples)
    model.source = (
        f"calibrated: model {config.model.name}, executor {config.executor.backend}, dtype {config.model.dtype}, "
        f"block {config.cache.block_size}, budget {config.scheduler.max_num_batched_tokens}"
    )
    model.num_blocks = num_blocks
    model.fit = {
        **quality,
        "probes": [list(p) for p in probes],
        "wall_s": round(wall, 2),
        "cpu": cpu.result,
    }
    return model
