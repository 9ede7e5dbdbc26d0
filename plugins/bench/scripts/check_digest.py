#!/usr/bin/env python3
"""Greedy output on a shared workload vs transformers, per request (the workload-digest check).

Runs baton on the workload (greedy, EOS ignored, exact max_new_tokens), and
transformers' static-batch generate through ../shared/bench/hf_baselines.py
(--dump-outputs), then compares request by request: equal, or diverging only at
a near-tie (top-2 logit gap < 1e-4 under transformers at the divergence).
Prints both digests and one line per request that differs.

    python plugins/bench/scripts/check_digest.py [--workload FILE] [--hf-outputs FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from baton import LLM, SamplingParams
from baton.model.loader import resolve_model
from baton_bench.common import default_bench_dir, digest, load_workload

TIE_GAP = 1e-4


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", default=str(default_bench_dir() / "workload.json"))
    ap.add_argument("--hf-outputs", help="reuse a --dump-outputs file of hf_baselines.py")
    a = ap.parse_args()
    wl = load_workload(a.workload)
    model_dir = resolve_model("smollm2-135m-instruct")

    with LLM(model=str(model_dir)) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": r.prompt_token_ids} for r in wl.requests],
            [
                SamplingParams(temperature=0, max_tokens=r.max_new_tokens, ignore_eos=True)
                for r in wl.requests
            ],
        )
    ours = {r.id: o.outputs[0].token_ids for r, o in zip(wl.requests, outs, strict=True)}

    hf_file = a.hf_outputs
    if hf_file is None:
        hf_file = os.path.join(tempfile.mkdtemp(), "hf.json")
        cmd = [
            sys.executable,
            str(default_bench_dir() / "hf_baselines.py"),
            "--workload",
            a.workload,
            "--mode",
            "generate-static",
            "--model-dir",
            str(model_dir),
            "--dump-outputs",
            hf_file,
        ]
        print("$", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    ref = json.loads(Path(hf_file).read_text())["outputs"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bad = 0
    for r in wl.requests:
        a_, b_ = ours[r.id], ref[r.id]
        if a_ == b_:
            continue
        k = next(
            (j for j, (x, y) in enumerate(zip(a_, b_, strict=False)) if x != y),
            min(len(a_), len(b_)),
        )
        with torch.inference_mode():
            logits = model(torch.tensor([r.prompt_token_ids + b_[:k]])).logits[0, -1]
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        tie = gap < TIE_GAP
        bad += not tie
        print(
            f"{r.id}: diverges at output token {k}/{len(b_)}: baton {a_[k]} vs transformers {b_[k]}, "
            f"top-2 gap {gap:.2e} -> {'near-tie' if tie else 'NOT a near-tie'}"
        )
    d_ours = digest(ours[r.id] for r in wl.requests)
    d_ref = digest(ref[r.id] for r in wl.requests)
    print(
        f"digest baton {d_ours} / transformers {d_ref}: "
        f"{'equal' if d_ours == d_ref else 'different'}; requests not explained by a near-tie: {bad}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
