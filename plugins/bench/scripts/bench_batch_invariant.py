"""executor.batch_invariant's cost in process CPU time: off and on, alternating rounds.

    .venv/bin/python plugins/bench/scripts/bench_batch_invariant.py --case batch1 --rounds 3 --repeats 5
    .venv/bin/python plugins/bench/scripts/bench_batch_invariant.py --case workload --rounds 2

Two offline ``LLM``s in this process (inproc transport: the engines' CPU time is this process's),
one intra-op thread each, so that no thread waits at a barrier for a peer the OS descheduled (a
shared host). ``batch1``: the workload's first prompt cut to 100 tokens, 128 greedy tokens;
``workload``: every request of workload.json at once. Prints one JSON line per run: CPU and
wall seconds, output tokens, output tokens per CPU second (prefill included) and the digest;
``--repeats`` runs the case several times per timed run, the sides' order alternating by round.
"""

from __future__ import annotations

import argparse
import json
import time

from baton import LLM, SamplingParams
from baton_bench.common import default_bench_dir, digest, load_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("batch1", "workload"), default="batch1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="generate the case this many times per timed run (longer runs average a noisy host)",
    )
    p.add_argument("--workload", default=str(default_bench_dir() / "workload.json"))
    args = p.parse_args()
    wl = load_workload(args.workload)
    if args.case == "batch1":
        first = wl.requests[0].prompt_token_ids
        prompts = [{"prompt_token_ids": (first * (100 // len(first) + 1))[:100]}]
        params = [SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)]
    else:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in wl.requests]
        params = [
            SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True)
            for r in wl.requests
        ]
    llms = {
        side: LLM(**{"executor.num_threads": 1, "executor.batch_invariant": side == "on"})
        for side in ("off", "on")
    }
    for rnd in range(args.rounds):
        # Alternate which side goes first: a host that slows within a round penalises both alike.
        for side in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
            llm = llms[side]
            c0, w0 = time.process_time(), time.perf_counter()
            n = 0
            for _ in range(args.repeats):
                llm.reset_prefix_cache()
                outs = llm.generate(prompts, params, use_tqdm=False)
                tokens = [o.outputs[0].token_ids for o in outs]
                n += sum(len(t) for t in tokens)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            line = {
                "case": args.case,
                "round": rnd,
                "batch_invariant": side,
                "cpu_s": round(cpu, 2),
                "wall_s": round(wall, 2),
                "output_tokens": n,
                "tok_per_cpu_s": round(n / cpu, 2),
                "digest": digest(tokens),
            }
            print(json.dumps(line), flush=True)
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
