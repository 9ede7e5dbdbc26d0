"""Time baton's ModelRunner alone (no engine, no scheduler) on a realistic workload.

    .venv/bin/python plugins/bench/scripts/profile_runner.py                 # SmolLM2, 2 threads, workload.json
    .venv/bin/python plugins/bench/scripts/profile_runner.py --profile decode64  # + torch.profiler table of one phase

Phases (greedy, fp32):
  prefill   all prompts of the workload, chunked under max_num_batched_tokens: prefill tokens/s
  decodeN   N requests (context = their prompt) decoding together: ms per step, tokens/s
  workload  the whole workload through a minimal continuous-batching driver
            (max_num_seqs 64, budget 2048): output tokens/s of the runner alone
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from baton.config import BatonConfig
from baton.protocol import KVCacheConfig
from baton.sampling_params import SamplingParams
from baton.testing.runner_driver import Driver
from baton.worker.model_runner import ModelRunner
from baton.worker.worker import runner_settings

WORKLOAD = Path("/work/shared/bench/workload.json")


class Timed:
    """Wraps a runner; records the wall time of every execute_model call."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.times: list[float] = []
        self.tokens: list[int] = []

    def execute_model(self, so):
        t0 = time.perf_counter()
        out = self.runner.execute_model(so)
        self.times.append(time.perf_counter() - t0)
        self.tokens.append(so.total_num_scheduled_tokens)
        return out


def make_runner(args, num_blocks: int) -> ModelRunner:
    cfg = BatonConfig.load(
        model=args.model,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget,
        num_threads=args.threads,
    )
    runner = ModelRunner(runner_settings(cfg), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(KVCacheConfig(num_blocks=num_blocks, block_size=args.block_size))
    return runner


def driver(runner, args, num_blocks) -> tuple[Driver, Timed]:
    timed = Timed(runner)
    return Driver(timed, num_blocks, args.block_size, budget=args.budget), timed


def phase_prefill(runner, reqs, args, num_blocks) -> dict:
    runner.input_batch.__init__(runner.max_num_reqs, runner.max_model_len, runner.block_size)
    d, timed = driver(runner, args, num_blocks)
    for r in reqs[: args.max_num_seqs]:
        d.add(str(r["id"]), r["prompt_token_ids"], max_tokens=1)
    d.run()
    total = sum(timed.tokens)
    return {
        "phase": "prefill",
        "steps": len(timed.times),
        "tokens": total,
        "tok_per_s": round(total / sum(timed.times), 1),
        "ms_per_step": round(1e3 * statistics.median(timed.times), 1),
    }


def phase_decode(runner, reqs, args, num_blocks, batch: int, steps: int = 12, prof=None) -> dict:
    runner.input_batch.__init__(runner.max_num_reqs, runner.max_model_len, runner.block_size)
    d, timed = driver(runner, args, num_blocks)
    for r in reqs[:batch]:
        d.add(str(r["id"]), r["prompt_token_ids"], max_tokens=steps + 1)
    while any(len(r.output) == 0 for r in d.running):  # prefill first, not timed
        d.step()
    timed.times.clear()
    with prof or contextlib.nullcontext():
        for _ in range(steps):
            d.step()
    ms = 1e3 * statistics.median(timed.times)
    ctx = statistics.mean(len(r["prompt_token_ids"]) for r in reqs[:batch])
    return {
        "phase": f"decode{batch}",
        "mean_context": round(ctx),
        "ms_per_step": round(ms, 1),
        "tok_per_s": round(batch / ms * 1e3, 1),
    }


def phase_workload(runner, reqs, args, num_blocks) -> dict:
    runner.input_batch.__init__(runner.max_num_reqs, runner.max_model_len, runner.block_size)
    d, timed = driver(runner, args, num_blocks)
    for r in reqs[: args.max_num_seqs]:
        d.add(
            str(r["id"]),
            r["prompt_token_ids"],
            max_tokens=r["max_new_tokens"],
            params=SamplingParams(temperature=0),
        )
    t0 = time.perf_counter()
    d.run()
    wall = time.perf_counter() - t0
    out = sum(len(r.output) for r in d.all.values())
    steps = list(zip(timed.times, timed.tokens, strict=True))
    # the digest hf_baselines.py prints (transformers generate gives 97fac8475fa226b2 on workload.json)
    h = hashlib.sha256()
    for r in reqs[: args.max_num_seqs]:
        h.update((",".join(map(str, d.all[str(r["id"])].output)) + ";").encode())
    return {
        "phase": "workload",
        "requests": len(d.all),
        "output_tokens": out,
        "steps": len(timed.times),
        "wall_s": round(wall, 2),
        "runner_s": round(sum(timed.times), 2),
        # steps that carry prompt tokens vs pure decode steps (at most max_num_seqs tokens)
        "mixed_steps_s": round(sum(t for t, n in steps if n > args.max_num_seqs), 2),
        "decode_steps_s": round(sum(t for t, n in steps if n <= args.max_num_seqs), 2),
        "tok_per_s": round(out / wall, 1),
        "outputs_sha256_16": h.hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", type=Path, default=WORKLOAD)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--phases", default="prefill,decode1,decode16,decode64,workload")
    ap.add_argument(
        "--malloc-tune", type=int, default=1, help="1: worker.tune_malloc() as the Worker does"
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each phase this many times (the machine is noisy)",
    )
    ap.add_argument("--profile", default=None, help="a phase to run again under torch.profiler")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)  # what Worker.init_device does with executor.num_threads
    if args.malloc_tune:
        from baton.worker.worker import tune_malloc

        tune_malloc()
    reqs = json.loads(args.workload.read_text())["requests"]
    num_blocks = 4096
    runner = make_runner(args, num_blocks)
    phases = {
        "prefill": lambda: phase_prefill(runner, reqs, args, num_blocks),
        "workload": lambda: phase_workload(runner, reqs, args, num_blocks),
    }
    for b in (1, 4, 16, 32, 64):
        phases[f"decode{b}"] = lambda b=b, prof=None: phase_decode(
            runner, reqs, args, num_blocks, b, prof=prof
        )
    print(
        json.dumps(
            {"threads": torch.get_num_threads(), "model": args.model, "block_size": args.block_size}
        )
    )
    for name in args.phases.split(","):
        for _ in range(args.repeat):
            print(json.dumps({**phases[name](), "load1": os.getloadavg()[0]}), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU])
        if args.profile.startswith("decode"):  # only the timed decode steps
            phases[args.profile](prof=prof)
        else:
            with prof:
                phases[args.profile]()
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr
        )


if __name__ == "__main__":
    main()
