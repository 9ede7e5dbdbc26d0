"""Benchmark: the cost of structured output on the engine step, and grammar compile time.

Step time: two EngineCores with the default model, 64 requests decoding in
each; in the "constrained" core 32 of them carry the nested JSON schema of the
tests (sampling at temperature 1), in the "unconstrained" core none does. The
two are stepped alternately (the order flipped every step), so the noise of a
shared machine hits both alike, and the k-th step of one is paired with the
k-th of the other: same context lengths, same moment. Only steps where all 64
requests decode count (64 scheduled tokens), the first ``--steps`` of each run.
The overhead is the median of the paired ratios (with their interquartile
range); step times are medians per run, then over runs. Also reported: the time
the core spends filling the bitmask (it overlaps the forward), and in
sample_tokens after the forward (bitmask applied, then sampling).

Compile: building the xgrammar backend (tokenizer tables) once, then the test
schema compiled cold (compiler cache cleared) and from the cache.

    HF_HUB_OFFLINE=1 .venv/bin/python plugins/bench/scripts/bench_structured.py [--runs 3] [--steps 24] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.model.tokenizer import load_tokenizer
from baton.protocol import EngineCoreRequest
from baton.sampling_params import SamplingParams, StructuredOutputSpec
from baton.worker import step_sampling
from tests.plugins.xgrammar.test_model import PERSON_SCHEMA

BATCH = 64
CONSTRAINED = 32
QUESTION = "Invent a person. Answer in JSON with name, age, address (city, zip) and tags."


class Timed:
    """Wraps a callable and records how long each call took."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.times: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - t0)


class Side:
    """One engine core and the per-step figures of the run it is in."""

    def __init__(self, name: str, model: str) -> None:
        self.name = name
        config = BatonConfig.load(
            model=model, max_num_seqs=BATCH, enable_prefix_caching=False, kv_cache_memory="1GiB"
        )
        self.core = EngineCore(config)
        tok = load_tokenizer(config.model, self.core.info)
        text = tok.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
        )
        self.prompt = tok.encode(text, add_special_tokens=False)
        self.eos = self.core.info.eos_token_ids[0]
        so = self.core.structured_output
        self.fill = so.grammar_bitmask = Timed(so.grammar_bitmask)  # type: ignore[method-assign]
        self.sample = self.core.executor.sample_tokens = Timed(self.core.executor.sample_tokens)  # type: ignore[method-assign]

    def start(self, constrained: bool, max_tokens: int, tag: str) -> None:
        spec = StructuredOutputSpec(json=PERSON_SCHEMA)  # type: ignore[arg-type]
        self.steps: list[float] = []
        self.fills: list[float] = []
        self.samples: list[float] = []
        self.applies: list[float] = []
        for i in range(BATCH):
            so = (
                spec if constrained and i % 2 == 0 else None
            )  # constrained rows interleaved with free ones
            params = SamplingParams(
                temperature=1.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so
            )
            self.core.add_request(
                EngineCoreRequest(
                    request_id=f"{tag}-{i}",
                    prompt_token_ids=self.prompt,
                    sampling_params=params,
                    eos_token_id=self.eos,
                )
            )

    def step(self, apply: Timed) -> bool:
        """One engine step; records it when all BATCH requests decoded. False when the run is over."""
        core = self.core
        if not core.has_work():
            return False
        n_fill, n_sample, n_apply = len(self.fill.times), len(self.sample.times), len(apply.times)
        t0 = time.perf_counter()
        core.step()
        dt = time.perf_counter() - t0
        sched = core.scheduler
        if sched._last_num_scheduled == BATCH and len(sched.requests) == BATCH:
            self.steps.append(dt)
            self.fills += self.fill.times[n_fill:]
            self.samples += self.sample.times[n_sample:]
            self.applies += apply.times[n_apply:]
        return True


def bench_steps(model: str, runs: int, steps: int) -> dict[str, Any]:
    """Two cores, stepped alternately (order flipped each step), so machine noise hits both alike."""
    apply = step_sampling.apply_bitmask = Timed(step_sampling.apply_bitmask)  # type: ignore[attr-defined]
    free, constrained = Side("unconstrained", model), Side("constrained", model)
    ratios: list[float] = []
    per_run: list[dict[str, float]] = []
    for r in range(-1, runs):  # run -1 warms up: backend, compile, runner
        n = 4 if r < 0 else steps
        free.start(False, n + 8, f"u{r}")
        constrained.start(True, n + 8, f"c{r}")
        k = 0
        while True:
            pair = (free, constrained) if k % 2 == 0 else (constrained, free)
            going = [side.step(apply) for side in pair]
            k += 1
            if not any(going):
                break
        if r < 0:
            continue
        m = min(len(free.steps), len(constrained.steps), steps)
        run_ratios = [c / u for u, c in zip(free.steps[:m], constrained.steps[:m], strict=True)]
        ratios += run_ratios
        res = {
            "unconstrained_step_ms": 1e3 * statistics.median(free.steps[:m]),
            "constrained_step_ms": 1e3 * statistics.median(constrained.steps[:m]),
            "overhead_pct": 100 * (statistics.median(run_ratios) - 1),
            "steps": m,
            "fill_ms": 1e3 * statistics.median(constrained.fills),
            "sample_tokens_ms": 1e3 * statistics.median(constrained.samples),
            "apply_bitmask_ms": 1e3 * statistics.median(constrained.applies),
        }
        per_run.append(res)
        print(
            f"run {r}: step {res['constrained_step_ms']:.1f} (constrained) vs {res['unconstrained_step_ms']:.1f} ms "
            f"over {m} paired steps, overhead {res['overhead_pct']:+.1f}%; fill {res['fill_ms']:.2f} ms, "
            f"sample_tokens {res['sample_tokens_ms']:.2f} ms (bitmask applied in {res['apply_bitmask_ms']:.2f} ms)",
            file=sys.stderr,
        )
    free.core.shutdown()
    constrained.core.shutdown()
    step_sampling.apply_bitmask = apply.fn  # type: ignore[attr-defined]
    q = statistics.quantiles(ratios, n=4)
    return {
        "batch": BATCH,
        "constrained_requests": CONSTRAINED,
        "runs": runs,
        "steps_per_run": steps,
        "runs_detail": per_run,
        "unconstrained_step_ms_median": statistics.median(
            r["unconstrained_step_ms"] for r in per_run
        ),
        "constrained_step_ms_median": statistics.median(r["constrained_step_ms"] for r in per_run),
        "overhead_pct_median": 100 * (statistics.median(ratios) - 1),
        "overhead_pct_iqr": [100 * (q[0] - 1), 100 * (q[2] - 1)],
        "overhead_pct_runs": [round(r["overhead_pct"], 1) for r in per_run],
        "fill_ms_median": statistics.median(r["fill_ms"] for r in per_run),
        "sample_tokens_ms_median": statistics.median(r["sample_tokens_ms"] for r in per_run),
        "apply_bitmask_ms_median": statistics.median(r["apply_bitmask_ms"] for r in per_run),
    }


def bench_compile(model: str, repeats: int) -> dict[str, Any]:
    from baton.model_info import model_info
    from baton.plugins import get_registry

    config = BatonConfig.load(model=model)
    info = model_info(config.model)
    tok = load_tokenizer(config.model, info)
    entry = get_registry().get("structured_output", "xgrammar")
    settings = config.plugin_settings("structured_output", "xgrammar", entry.settings_model)
    t0 = time.perf_counter()
    backend = entry.create(config, settings, tok, info.vocab_size)
    build = time.perf_counter() - t0
    spec = StructuredOutputSpec(json=PERSON_SCHEMA)  # type: ignore[arg-type]
    cold, warm = [], []
    for _ in range(repeats):
        backend.compiler.clear_cache()
        t0 = time.perf_counter()
        backend.compile(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        backend.compile(spec)
        warm.append(time.perf_counter() - t0)
    return {
        "backend_build_ms": 1e3 * build,
        "compile_cold_ms_median": 1e3 * statistics.median(cold),
        "compile_cold_ms_min": 1e3 * min(cold),
        "compile_cold_ms_max": 1e3 * max(cold),
        "compile_cached_ms_median": 1e3 * statistics.median(warm),
        "repeats": repeats,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--compile-repeats", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = {
        "compile": bench_compile(args.model, args.compile_repeats),
        "step": bench_steps(args.model, args.runs, args.steps),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        c, s = result["compile"], result["step"]
        print(
            f"xgrammar backend build: {c['backend_build_ms']:.0f} ms; test schema compile: cold median "
            f"{c['compile_cold_ms_median']:.1f} ms (min {c['compile_cold_ms_min']:.1f}, max "
            f"{c['compile_cold_ms_max']:.1f}), cached {c['compile_cached_ms_median']:.3f} ms"
        )
        print(
            f"step, {s['batch']} requests decoding, {s['constrained_requests']} of them constrained vs none: "
            f"{s['constrained_step_ms_median']:.1f} vs {s['unconstrained_step_ms_median']:.1f} ms; overhead "
            f"(median of paired-step ratios) {s['overhead_pct_median']:+.1f}%, IQR "
            f"[{s['overhead_pct_iqr'][0]:+.1f}%, {s['overhead_pct_iqr'][1]:+.1f}%], per run {s['overhead_pct_runs']}; "
            f"bitmask fill {s['fill_ms_median']:.2f} ms (overlaps the forward), sample_tokens "
            f"{s['sample_tokens_ms_median']:.2f} ms, of which applying the bitmask {s['apply_bitmask_ms_median']:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
