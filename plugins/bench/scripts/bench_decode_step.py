"""Batch-1 decode latency with executor.fast_decode on and off, in one process.

    .venv/bin/python plugins/bench/scripts/bench_decode_step.py                # a 30-layer Llama of width 64
    .venv/bin/python plugins/bench/scripts/bench_decode_step.py --model smollm2-135m-instruct

The narrow model (30 layers, hidden 64: compute negligible but for its 49152 x 64 LM head)
shows a step's fixed cost: Python, op dispatch, input preparation, sampling and scheduling.
Each setting runs baton's latency benchmark (``baton bench latency``'s run_latency: medians
of per-token wall time over --repeats generations) and measures the process's CPU time per
decoded token (two generations of different lengths, the difference divided by the extra
tokens): on a busy machine the CPU time is the steadier figure; with --threads 1 it is what
the wall time would be on an idle core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The narrow model: SmolLM2-135M's depth and head layout at width 64.
NARROW = dict(
    num_hidden_layers=30,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def narrow_model() -> Path:
    from baton.testing.tiny_model import make_tiny_model

    dest = Path(tempfile.gettempdir()) / "baton-bench-narrow-llama-30x64"
    if not (dest / "config.json").exists():
        make_tiny_model("llama", dest, **NARROW)
    return dest


def cpu_ms_per_token(llm, decode_tokens: int, repeats: int) -> float:
    """Median process CPU ms per decoded token at batch 1 (a 100-token prompt, prefix cache reset)."""
    from baton import SamplingParams

    prompt = {"prompt_token_ids": list(range(1000, 1100))}

    def cpu(n: int) -> float:
        llm.reset_prefix_cache()
        t0 = time.process_time()
        llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )
        return time.process_time() - t0

    per = [(cpu(1 + decode_tokens) - cpu(1)) / decode_tokens * 1000 for _ in range(repeats)]
    return round(statistics.median(per), 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a model (default: the narrow 30x64 Llama)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = p.parse_args()

    from baton import LLM
    from baton_bench.common import default_bench_dir
    from baton_bench.latency import run_latency

    model = args.model or str(narrow_model())
    extra = dict(kv.split("=", 1) for kv in args.set)
    results = {}
    for fast in (False, True):
        with LLM(model=model, num_threads=args.threads, fast_decode=fast, **extra) as llm:
            r = run_latency(
                llm,
                str(default_bench_dir() / "workload.json"),
                args.prompt_len,
                args.decode_tokens,
                args.repeats,
            )
            cpu = cpu_ms_per_token(llm, args.decode_tokens, args.repeats)
        results[f"fast_decode={fast}"] = {
            "cpu_ms_per_token_median": cpu,
            "per_token_ms_median": r["per_token_ms_median"],
            "decode_tok_per_s": r["decode_tok_per_s"],
            "ttft_ms_median": r["ttft_ms"]["median"],
        }
    print(json.dumps({"model": model, "threads": args.threads, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
