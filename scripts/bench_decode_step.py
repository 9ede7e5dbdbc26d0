"""Batch-1 decode latency with executor.fast_decode on and off, in one process.

    .venv/bin/python scripts/bench_decode_step.py                # a 30-layer Llama of width 64
    .venv/bin/python scripts/bench_decode_step.py --model smollm2-135m-instruct

The narrow model (30 layers, hidden 64: compute negligible) shows a step's fixed cost:
Python, op dispatch, input preparation, sampling and scheduling. Each setting runs
baton's latency benchmark (``baton bench latency``'s run_latency); the numbers are
medians of per-token decode time over --repeats generations.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
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
    from baton.bench.common import default_bench_dir
    from baton.bench.latency import run_latency

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
        results[f"fast_decode={fast}"] = {
            "per_token_ms_median": r["per_token_ms_median"],
            "decode_tok_per_s": r["decode_tok_per_s"],
            "ttft_ms_median": r["ttft_ms"]["median"],
        }
    print(json.dumps({"model": model, "threads": args.threads, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
