"""Multi-turn chat sessions, more of them than the KV pool holds: TTFT of returning turns,
cached prompt tokens, output tokens/s.

``baton bench multiturn`` replays a multi-turn workload (``baton_bench.multiturn_workload``:
generated with the engine's tokenizer from ``--sessions``, ``--turns`` and ``--seed``, or read
from ``--workload``) on an in-process ``AsyncLLM``, in waves: turn t of every session before
turn t+1 of any, at most ``--concurrency`` requests in flight, each turn's prompt the
conversation so far (the previous prompt, the model's greedy answer, the next user message).
With a KV pool smaller than the sessions need (``--set cache.kv_cache_memory=24MiB``) a
returning turn finds its conversation evicted, unless a KV tier kept it (``--set
kv_transfer.connector=offload``).

Every request's session, turn, prompt tokens, cached tokens (``RequestOutput.num_cached_tokens``),
TTFT (sent to first token, as the caller sees it) and output tokens are recorded, with a KV
connector its figures summed over the run (tokens served per tier, bytes and seconds of loads
and saves: ``SchedulerStats.kv_transfer``); the report
gives per turn the TTFT p50/p90 and the cached fraction of the prompt tokens, the returning
turns (2 and later) together, output tokens/s over the run (and per CPU second of this process
and its children: a figure a busy shared host disturbs less) and the digest of every generated
token. ``--compare KEY=VALUE`` (repeatable) adds a second side, the same engine settings plus
these: ``--rounds`` rounds alternating the sides (A B, B A, ...), a fresh engine for every run
(nothing cached carried over; a disk tier that outlives its engine needs a fresh path), medians
per side and B's ratios to A.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from baton.cli.main import add_engine_arguments, engine_overrides
from baton.errors import BatonError
from baton.metrics.logging_logger import KVTransferTally
from baton_bench.common import CpuMonitor, digest, emit, percentile
from baton_bench.multiturn_workload import (
    MultiTurnWorkload,
    load_multiturn,
    multiturn,
    next_prompt,
    write_multiturn,
)

#: The warm-up request's prompt: token ids no workload prompt starts with (no template).
WARMUP_PROMPT = list(range(1000, 1064))


class TurnRecord(msgspec.Struct, kw_only=True):
    """One request of a session, as the caller saw it (seconds on its clock)."""

    session: str
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    expected_tokens: int
    ttft_s: float
    e2e_s: float


class KVTransferRecorder:
    """A stat logger hooked onto an engine for one run: the KV connector's figures
    (``SchedulerStats.kv_transfer``, deltas per step) summed; ``tally`` None: no connector."""

    def __init__(self) -> None:
        self.tally: KVTransferTally | None = None

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_index: int = 0) -> None:
        step = getattr(scheduler_stats, "kv_transfer", None)
        if step is not None:
            self.tally = self.tally or KVTransferTally()
            self.tally.add(step)

    def log(self) -> None:
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", help="a multiturn-workload/v1 JSON (default: generate one)")
    p.add_argument("--sessions", type=int, default=8, help="generated workload: sessions")
    p.add_argument("--turns", type=int, default=2, help="generated workload: turns per session")
    p.add_argument("--seed", type=int, default=0, help="generated workload: its seed")
    p.add_argument(
        "--first-prompt-tokens",
        type=int,
        default=350,
        help="generated workload: a session's first prompt, in tokens (about)",
    )
    p.add_argument(
        "--max-new-tokens",
        default="32:48",
        help="generated workload: each turn's output tokens, LOW:HIGH (seeded) or N",
    )
    p.add_argument("--save-workload", help="write the workload replayed to this file")
    p.add_argument(
        "--concurrency", type=int, default=1, help="at most this many requests in flight"
    )
    p.add_argument("--rounds", type=int, default=1, help="runs per side (medians reported)")
    p.add_argument(
        "--compare",
        action="append",
        metavar="SECTION.FIELD=VALUE",
        help="a second side: the engine settings plus these (repeatable), e.g. "
        "kv_transfer.connector=offload",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--per-request", action="store_true", help="include every request's record")
    add_engine_arguments(p)


def output_range(spec: str) -> tuple[int, int]:
    """``--max-new-tokens``: "LOW:HIGH" or "N"."""
    lo, _, hi = spec.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise BatonError(f"--max-new-tokens {spec!r}: give N or LOW:HIGH, e.g. 32:48") from None


async def replay(
    llm: Any, workload: MultiTurnWorkload, concurrency: int = 1
) -> tuple[list[TurnRecord], list[list[int]], float]:
    """Run every session's turns in waves (see the module docstring); returns the records and
    the generated tokens (sessions in order, each's turns in order) and the run's seconds."""
    from baton import SamplingParams

    if concurrency < 1:
        raise BatonError(f"--concurrency {concurrency}: give at least 1")
    gate = asyncio.Semaphore(concurrency)
    prompts: dict[str, list[int]] = {}
    answers: dict[tuple[str, int], list[int]] = {}
    records: list[TurnRecord] = []

    async def one(session_index: int, t: int) -> None:
        session = workload.sessions[session_index]
        turn = session.turns[t]
        prompt = (
            list(turn.token_ids)
            if t == 0
            else next_prompt(prompts[session.id], answers[session.id, t - 1], turn)
        )
        prompts[session.id] = prompt
        params = SamplingParams(temperature=0.0, max_tokens=turn.max_new_tokens, ignore_eos=True)
        async with gate:
            sent, first, final = time.perf_counter(), None, None
            async for out in llm.generate(
                {"prompt_token_ids": prompt}, params, request_id=f"{session.id}-turn{t + 1}"
            ):
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
                final = out
            done = time.perf_counter()
        assert final is not None and first is not None
        tokens = list(final.outputs[0].token_ids)
        answers[session.id, t] = tokens
        records.append(
            TurnRecord(
                session=session.id,
                turn=t + 1,
                prompt_tokens=len(prompt),
                cached_tokens=final.num_cached_tokens,
                output_tokens=len(tokens),
                expected_tokens=turn.max_new_tokens,
                ttft_s=first - sent,
                e2e_s=done - sent,
            )
        )

    t0 = time.perf_counter()
    for t in range(max(len(s.turns) for s in workload.sessions)):
        wave = [i for i, s in enumerate(workload.sessions) if t < len(s.turns)]
        await asyncio.gather(*(one(i, t) for i in wave))
    duration = time.perf_counter() - t0
    outputs = [answers[s.id, t] for s in workload.sessions for t in range(len(s.turns))]
    records.sort(key=lambda r: (r.session, r.turn))
    return records, outputs, duration


def turn_figures(records: Sequence[TurnRecord]) -> dict[str, Any]:
    """Requests, prompt and cached tokens, the cached fraction and TTFT p50/p90 of ``records``."""
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    ttfts = [r.ttft_s for r in records]
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_frac": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_s": {f"p{q}": round(percentile(ttfts, q), 4) for q in (50, 90)},
    }


def report(
    records: Sequence[TurnRecord], outputs: Sequence[Sequence[int]], duration: float
) -> dict[str, Any]:
    """One run's figures: per turn, the returning turns together, throughput, the digest."""
    tokens = sum(r.output_tokens for r in records)
    turns = sorted({r.turn for r in records})
    returning = [r for r in records if r.turn > 1]
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "duration_s": round(duration, 3),
        "tok_per_s": round(tokens / duration, 2) if duration > 0 else 0.0,
        "expected_tokens_ok": all(r.output_tokens == r.expected_tokens for r in records),
        "turns": [{"turn": t, **turn_figures([r for r in records if r.turn == t])} for t in turns],
        "returning": turn_figures(returning) if returning else None,
        "outputs_sha256_16": digest(outputs),
    }


async def run_once(
    overrides: dict[str, Any],
    config: str | None,
    workload: MultiTurnWorkload | None,
    generate: dict[str, Any],
    concurrency: int,
) -> tuple[dict[str, Any], list[TurnRecord], MultiTurnWorkload]:
    """A fresh engine, a warm-up request, the workload (generated with the engine's tokenizer
    when ``workload`` is None); returns the run's report, its records and the workload."""
    from baton import AsyncLLM, SamplingParams

    t0 = time.perf_counter()
    llm = await AsyncLLM.create(config=config, **overrides)
    try:
        startup = time.perf_counter() - t0
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for _ in llm.generate({"prompt_token_ids": WARMUP_PROMPT}, warm):
            pass
        await llm.reset_prefix_cache()
        if workload is None:
            workload = multiturn(llm.tokenizer, **generate)
        kv = KVTransferRecorder()
        llm.stat_loggers.loggers.append(kv)  # fed only with observability.log_stats on
        with CpuMonitor() as cpu:
            records, outputs, duration = await replay(llm, workload, concurrency)
        stats = await llm.get_stats()
    finally:
        llm.shutdown()
    result = report(records, outputs, duration)
    result["kv_blocks"] = stats.num_total_blocks
    if kv.tally is not None:
        result["kv_transfer"] = msgspec.to_builtins(kv.tally.total)
    cpu_s = cpu.result["self_cpu_s"] if cpu.result else 0.0
    result["tok_per_cpu_s"] = round(result["output_tokens"] / cpu_s, 2) if cpu_s > 0 else None
    result["startup_s"] = round(startup, 2)
    result["cpu"] = cpu.result
    return result, records, workload


def side_medians(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The medians over a side's runs of what the comparison is about."""

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    first = [r["turns"][0] for r in runs]
    back = [r["returning"] for r in runs if r["returning"] is not None]
    return {
        "runs": len(runs),
        "tok_per_s": med([r["tok_per_s"] for r in runs]),
        "tok_per_cpu_s": med([r["tok_per_cpu_s"] for r in runs if r["tok_per_cpu_s"]]),
        "others_cpu_frac": med([r["cpu"]["others_cpu_frac"] for r in runs if r["cpu"]]),
        "first_turn_ttft_p50_s": med([f["ttft_s"]["p50"] for f in first]),
        "returning_ttft_p50_s": med([b["ttft_s"]["p50"] for b in back]),
        "returning_ttft_p90_s": med([b["ttft_s"]["p90"] for b in back]),
        "returning_cached_frac": med([b["cached_frac"] for b in back]),
        "digests": sorted({r["outputs_sha256_16"] for r in runs}),
    }


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Side B's medians over side A's, and whether every run generated the same tokens."""

    def ratio(key: str) -> float | None:
        return round(b[key] / a[key], 3) if a.get(key) and b.get(key) is not None else None

    return {
        "returning_ttft_p50": ratio("returning_ttft_p50_s"),
        "returning_ttft_p90": ratio("returning_ttft_p90_s"),
        "tok_per_s": ratio("tok_per_s"),
        "tok_per_cpu_s": ratio("tok_per_cpu_s"),
        "same_outputs": a["digests"] == b["digests"] and len(a["digests"]) == 1,
    }


async def run_sides(
    args: argparse.Namespace, sides: dict[str, dict[str, Any]]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[TurnRecord]], MultiTurnWorkload | None]:
    workload = load_multiturn(args.workload) if args.workload else None
    generate = {
        "sessions": args.sessions,
        "turns": args.turns,
        "seed": args.seed,
        "first_prompt_tokens": args.first_prompt_tokens,
        "max_new_tokens": output_range(args.max_new_tokens),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    records: dict[str, list[TurnRecord]] = {}
    names = list(sides)
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            result, recs, workload = await run_once(
                sides[name], args.config, workload, generate, args.concurrency
            )
            runs[name].append({"round": rnd, **result})
            records[name] = recs
    return runs, records, workload


def table(result: dict[str, Any]) -> str:
    """The report as text: per side and run, each turn's TTFT and cached fraction; the medians."""
    lines = [f"workload {result['workload']}: {result['workload_summary']}"]
    for name, side in result["sides"].items():
        lines.append(f"side {name}: {' '.join(side['settings']) or '(the engine settings)'}")
        for run in side["runs"]:
            lines.append(
                f"  round {run['round']}: {run['tok_per_s']} output tok/s, "
                f"{run['tok_per_cpu_s']} per CPU s, others' CPU {run['cpu']['others_cpu_frac']}"
            )
            returning = [{"turn": "2+", **run["returning"]}] if len(run["turns"]) > 2 else []
            for fig in [*run["turns"], *returning]:
                lines.append(
                    f"    turn {fig['turn']}: TTFT p50 {fig['ttft_s']['p50']} s, "
                    f"p90 {fig['ttft_s']['p90']} s, cached {fig['cached_tokens']} of "
                    f"{fig['prompt_tokens']} prompt tokens ({fig['cached_frac']:.1%})"
                )
        lines.append(f"  medians: {side['medians']}")
    if "b_over_a" in result:
        lines.append(f"B / A: {result['b_over_a']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise BatonError(f"--rounds {args.rounds}: give at least 1")
    base = engine_overrides(args)
    sides = {"A": base}
    if args.compare:
        both = argparse.Namespace(**{**vars(args), "set": [*(args.set or []), *args.compare]})
        sides["B"] = engine_overrides(both)
    runs, records, workload = asyncio.run(run_sides(args, sides))
    assert workload is not None
    if args.save_workload:
        write_multiturn(workload, args.save_workload)
    medians = {name: side_medians(r) for name, r in runs.items()}
    result: dict[str, Any] = {
        "bench": "multiturn",
        "workload": args.workload or workload.name,
        "workload_summary": workload.summary,
        "concurrency": args.concurrency,
        "sides": {
            name: {
                "settings": list(args.set or []) + (args.compare if name == "B" else []),
                "medians": medians[name],
                "runs": runs[name],
            }
            for name in sides
        },
    }
    if "B" in sides:
        result["b_over_a"] = ratios(medians["A"], medians["B"])
    if args.per_request:
        result["per_request"] = {n: msgspec.to_builtins(r) for n, r in records.items()}
    if args.json:
        emit(result, True)
    else:
        print(table(result))
    ok = all(r["expected_tokens_ok"] for side in runs.values() for r in side)
    return 0 if ok else 1
