#!/usr/bin/env python3
"""How far a non-exact mode moves the model: teacher-forced top-1 agreement and mean KL.

    .venv/bin/python plugins/bench/scripts/bench_agreement.py --set model.activation_quantization=int8 \
        [--reference-set model.quantization=auto] [--prompts 16] [--max-tokens 64]

The reference (baton with ``--reference-set``, default: the default config, exact
weight-only quantization) generates greedy continuations of the first
``--prompts`` prompts of workload.json. Both configurations' models are then
loaded as baton loads them (quantized layers included) and run on each prompt +
continuation in one forward pass with SDPA attention, every row through the
decode-sized kernels (QuantLinear.KERNEL_MAX_ROWS raised), so a mode that
quantizes activations does so at every position. Over the continuation's
positions: the share where both argmaxes agree, and the mean KL(reference ||
candidate) of the next-token distributions. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.model.weights import load_model
from baton.quant import QuantLinear
from baton_bench.common import default_bench_dir


def parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def teacher_forced_logits(
    overrides: dict[str, str], sequences: list[list[int]]
) -> list[torch.Tensor]:
    cfg = BatonConfig.load(**overrides)
    model = load_model(cfg.model, cfg.executor, torch.device("cpu"))
    model.set_attn_implementation("sdpa")
    out = []
    with torch.inference_mode():
        for seq in sequences:
            ids = torch.tensor([seq])
            out.append(model(input_ids=ids, use_cache=False).logits[0].float())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], help="candidate KEY=VALUE")
    ap.add_argument("--reference-set", action="append", default=[], help="reference KEY=VALUE")
    ap.add_argument("--workload", default=str(default_bench_dir() / "workload.json"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    ref_over, cand_over = parse_sets(args.reference_set), parse_sets(args.set)
    with open(args.workload) as f:
        workload = json.load(f)
    prompts = [
        {"prompt_token_ids": r["prompt_token_ids"]} for r in workload["requests"][: args.prompts]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(**ref_over) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    starts = [len(o.prompt_token_ids) - 1 for o in outs]  # logits that predict the continuation

    QuantLinear.KERNEL_MAX_ROWS = 1 << 30  # every row through the decode-sized path
    ref = teacher_forced_logits(ref_over, sequences)
    cand = teacher_forced_logits({**ref_over, **cand_over}, sequences)
    agree, kls = [], []
    for r, c, s in zip(ref, cand, starts, strict=True):
        r, c = r[s:-1], c[s:-1]
        agree.append((r.argmax(-1) == c.argmax(-1)).float().mean().item())
        lr, lc = torch.log_softmax(r, -1), torch.log_softmax(c, -1)
        kls.append((lr.exp() * (lr - lc)).sum(-1).mean().item())
    print(
        json.dumps(
            {
                "candidate": cand_over,
                "reference": ref_over,
                "prompts": len(sequences),
                "positions": sum(len(s) - st - 1 for s, st in zip(sequences, starts, strict=True)),
                "top1_agreement": round(statistics.fmean(agree), 4),
                "mean_kl": float(f"{statistics.fmean(kls):.3g}"),
                "machine": platform.processor() or platform.machine(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
