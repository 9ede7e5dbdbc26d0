"""Time every model step of a workload by the number of rows it runs (speculation's verify cost).

    .venv/bin/python plugins/bench/scripts/profile_spec_steps.py --method ngram   # or none
    .venv/bin/python plugins/bench/scripts/profile_spec_steps.py --workload ../shared/bench/workload.json --max-num-seqs 64

The offline ``LLM`` in one process, greedy, ``ModelRunner.execute_model`` timed. Prints one JSON
line: wall and runner seconds, then per row count (steps with more than 8 rows together) the
number of steps, their median ms and their total seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from baton import LLM, SamplingParams
from baton.worker.model_runner import ModelRunner

WORKLOAD = Path(__file__).resolve().parents[4] / "shared" / "bench" / "workload_grounded.json"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", type=Path, default=WORKLOAD)
    ap.add_argument("--method", default="ngram", help="speculative.method (none: off)")
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    steps: list[tuple[int, float]] = []
    execute = ModelRunner.execute_model

    def timed(self, scheduler_output, *a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = execute(self, scheduler_output, *a, **k)
        steps.append((scheduler_output.total_num_scheduled_tokens, time.perf_counter() - t0))
        return out

    ModelRunner.execute_model = timed  # type: ignore[method-assign]
    reqs = json.loads(args.workload.read_text())["requests"]
    spec = {"speculative": {"method": args.method}} if args.method != "none" else {}
    llm = LLM(max_num_seqs=args.max_num_seqs, num_threads=args.threads, **spec)
    t0 = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs],
        [SamplingParams(temperature=0, max_tokens=r["max_new_tokens"]) for r in reqs],
        use_tqdm=False,
    )
    wall = time.perf_counter() - t0
    by_rows: dict[int, list[float]] = collections.defaultdict(list)
    for n, t in steps:
        by_rows[min(n, 9)].append(t)
    print(
        json.dumps(
            {
                "method": args.method,
                "wall_s": round(wall, 2),
                "runner_s": round(sum(t for _, t in steps), 2),
                "steps": {
                    ("9+" if n == 9 else str(n)): {
                        "count": len(ts),
                        "median_ms": round(1e3 * statistics.median(ts), 2),
                        "sum_s": round(sum(ts), 2),
                    }
                    for n, ts in sorted(by_rows.items())
                },
            }
        )
    )


if __name__ == "__main__":
    main()
