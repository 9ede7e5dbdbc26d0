"""Benchmark: LoRA batching overhead against no adapter.

One batch of ``--batch`` greedy requests (``--prompt-len`` random prompt tokens, ``--max-tokens``
generated, EOS ignored) through ``LLM.generate``, in these cases:

- ``lora off``: an engine without ``lora.enable_lora`` (the reference);
- ``lora off, no fast decode``: the same with ``executor.fast_decode`` off: transformers'
  modules every step, the path a step with an adapter takes (so the adapters' own cost is the
  difference to this row);
- ``0 adapters``: an engine with LoRA on (``max_loras`` 4), no request naming an adapter (the
  wrapped layers' cost when idle: decode still takes fast_decode's native stack);
- ``1 adapter``: every request with the same adapter;
- ``4 adapters``: the requests spread over 4 adapters in the one batch (the batched low-rank
  matmul over 4 slots);
- ``4 adapters, a batch each``: the same 4 adapters, one ``generate`` per adapter (what one
  forward per adapter would cost at best).

The adapters are random rank-``--rank`` factors on every q/k/v/o/gate/up/down projection,
written as PEFT folders (no peft needed). The cases run in turn, ``--runs`` times, so that a
shared machine's noise hits them alike; each case's median wall time counts (best beside it),
with the share of CPU other processes took meanwhile (``others_cpu_frac``).

    HF_HUB_OFFLINE=1 .venv/bin/python plugins/bench/scripts/bench_lora.py [--model smollm2-135m-instruct]
        [--batch 16] [--prompt-len 64] [--max-tokens 64] [--rank 16] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from baton import LLM, SamplingParams
from baton.lora import LoRARequest
from baton.lora.adapter import TARGET_MODULES
from baton_bench.common import CpuMonitor


def write_adapter(model: torch.nn.Module, dest: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for ``model``'s decoder projections."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGET_MODULES and hasattr(module, "in_features"):
            key = f"base_model.model.{name}"
            scale = 1.0 / module.in_features**0.5
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, module.in_features, generator=g) * scale
            )
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(module.out_features, rank, generator=g) * 0.01
            )
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    targets = sorted({k.split(".")[-3] for k in tensors})
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    common = dict(model=args.model, device="cpu", max_model_len=1024, kv_cache_memory=256 << 20)
    off = LLM(**common)
    modules = LLM(**common, fast_decode=False)
    on = LLM(**common, enable_lora=True, max_loras=4, max_lora_rank=args.rank)
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-lora-"))
    runner = on.engine.core.executor.worker.model_runner
    loras = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(runner.model, tmp / f"a{i}", args.rank, i)))
        for i in range(4)
    ]
    for lora in loras:
        on.add_lora(lora)
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 40000, (args.prompt_len,), generator=g).tolist()}
        for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(llm: LLM, which: list[LoRARequest | None]) -> None:
        llm.generate(prompts, params, use_tqdm=False, lora_request=which)

    def per_adapter() -> None:
        for k in range(4):
            part = [i for i in range(args.batch) if i % 4 == k]
            on.generate([prompts[i] for i in part], params, use_tqdm=False, lora_request=loras[k])

    cases = {
        "lora off": lambda: run(off, [None] * args.batch),
        "lora off, no fast decode": lambda: run(modules, [None] * args.batch),
        "0 adapters": lambda: run(on, [None] * args.batch),
        "1 adapter": lambda: run(on, [loras[0]] * args.batch),
        "4 adapters": lambda: run(on, [loras[i % 4] for i in range(args.batch)]),
        "4 adapters, a batch each": per_adapter,
    }
    for fn in cases.values():  # warm-up: kernels, slots
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    with CpuMonitor() as cpu:
        for _ in range(args.runs):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.max_tokens
    med = {name: statistics.median(t) for name, t in times.items()}
    ref = med["lora off"]
    rows = [
        {
            "case": name,
            "median_s": med[name],
            "best_s": min(t),
            "output_tok_s": tokens / med[name],
            "vs_lora_off": med[name] / ref,
        }
        for name, t in times.items()
    ]
    load = os.getloadavg()
    monitor = cpu.result or {}
    if args.json:
        print(json.dumps({"args": vars(args), "cpu": monitor, "rows": rows}, indent=2))
    else:
        print(
            f"{args.model}: {args.batch} requests x ({args.prompt_len} prompt + {args.max_tokens} "
            f"generated) tokens, rank {args.rank}, {args.runs} runs; others_cpu_frac "
            f"{monitor.get('others_cpu_frac')}, load average {load[0]:.2f} {load[1]:.2f} "
            f"{load[2]:.2f} on {os.cpu_count()} CPUs"
        )
        print("| case | median s | best s | output tok/s | time vs lora off |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['case']} | {r['median_s']:.2f} | {r['best_s']:.2f} | "
                f"{r['output_tok_s']:.0f} | {r['vs_lora_off']:.2f}x |"
            )
    for llm in (off, modules, on):
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
