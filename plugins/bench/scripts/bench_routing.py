#!/usr/bin/env python3
"""Data-parallel routing on a multi-tenant workload: prefix-cache hit rate per router.

    .venv/bin/python plugins/bench/scripts/bench_routing.py [--tenants 8] [--per-tenant 16] [--prefix 512]
        [--routers least-loaded,prefix-aware] [--dp 2] [--model M] [--kv-cache-memory 120MiB]
        [--max-concurrency 4] [--json]

The workload: ``--tenants`` system prompts of ``--prefix`` random tokens each (seeded),
``--per-tenant`` requests per tenant (its prompt, then ``--suffix`` tokens of its own),
``--max-tokens`` greedy tokens each, sent in a shuffled order to ``AsyncLLM`` with
``executor.data_parallel_size = --dp`` (engine processes over zmq), once per router: all at
once, or with ``--max-concurrency N`` at most N in flight (a client pool: each request is
routed when the one before it finishes, as traffic that keeps coming rather than one burst).
Reports each router's prefix-cache hit rate (prompt tokens found cached over prompt tokens
looked up, summed over the engines' scheduler stats), each engine's share, output tokens/s,
the output digest (the same for every router: routing changes no token) and the ratio of the
hit rates to the first router's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
from typing import Any

from baton import AsyncLLM, SamplingParams
from baton_bench.common import CpuMonitor


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    vocab = range(1000, 40000)  # ordinary tokens of the SmolLM2 vocabulary
    prompts = []
    for _ in range(args.tenants):
        prefix = [rng.choice(vocab) for _ in range(args.prefix)]
        for _ in range(args.per_tenant):
            prompts.append(prefix + [rng.choice(vocab) for _ in range(args.suffix)])
    rng.shuffle(prompts)
    return prompts


async def run(router: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {"model": args.model} if args.model else {}
    if args.kv_cache_memory:
        overrides["kv_cache_memory"] = args.kv_cache_memory
    llm = await AsyncLLM.create(
        data_parallel_size=args.dp,
        transport=args.transport,
        routing={"router": router},
        num_threads=args.threads,
        **overrides,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

        slots = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def one(i: int, p: list[int]) -> list[int]:
            out: list[int] = []
            async with slots:
                async for o in llm.generate({"prompt_token_ids": p}, params, f"r{i}"):
                    out = list(o.outputs[0].token_ids)
            return out

        with CpuMonitor() as cpu:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            wall = time.perf_counter() - t0
        loads = llm.engine.engine_loads()  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
    queries = sum(e.prefix_cache_queries for e in loads)
    hits = sum(e.prefix_cache_hits for e in loads)
    digest = hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]
    return {
        "router": router,
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "per_engine": [
            {"hits": e.prefix_cache_hits, "queries": e.prefix_cache_queries} for e in loads
        ],
        "output_tok_per_s": round(sum(map(len, outs)) / wall, 2),
        "wall_s": round(wall, 2),
        "outputs_sha256_16": digest,
        "cpu": cpu.result,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--per-tenant", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=512, help="tokens of each tenant's shared prefix")
    ap.add_argument("--suffix", type=int, default=32, help="tokens of each request's own")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--routers", default="least-loaded,prefix-aware")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--transport", default="zmq")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--model", help="default: the config's model (smollm2-135m-instruct)")
    ap.add_argument(
        "--kv-cache-memory",
        help="each engine's KV cache (cache.kv_cache_memory, e.g. 300MiB): smaller than every "
        "tenant's prefix together, it tells routers that keep a tenant on one engine apart",
    )
    ap.add_argument(
        "--max-concurrency",
        type=int,
        help="requests in flight at most (default: all at once)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    prompts = workload(args)
    results = [asyncio.run(run(r, prompts, args)) for r in args.routers.split(",")]
    base = results[0]["hit_rate"]
    for r in results:
        r["hit_rate_vs_first"] = round(r["hit_rate"] / base, 3) if base else None
    summary = {
        "requests": len(prompts),
        "tenants": args.tenants,
        "prefix_tokens": args.prefix,
        "dp": args.dp,
        "kv_cache_memory": args.kv_cache_memory,
        "max_concurrency": args.max_concurrency,
        "same_outputs": len({r["outputs_sha256_16"] for r in results}) == 1,
        "results": results,
    }
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0 if summary["same_outputs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
