"""``baton run-batch -i IN.jsonl -o OUT.jsonl``: a batch file run offline (vLLM's run_batch).

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with url
/v1/chat/completions, /v1/completions or /v1/embeddings (lines may mix them).
The engine starts in this process, each line runs through the same handler the
server would call (batch/lines.py), and OUT gets one line per input line, in
input order: ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``, a malformed line with ``response`` null and ``error`` set.
OUT is written whole at the end (temp file + rename).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import msgspec

from baton import AsyncLLM
from baton.cli.main import add_engine_arguments, engine_overrides
from baton.config import BatonConfig
from baton_openai.batch.file_store import write_atomic
from baton_openai.batch.lines import (
    EngineGone,
    LineRejected,
    LineRunner,
    ResultLine,
    parse_line,
    rejected_line,
    result_line,
)
from baton_openai.batch.runner import input_lines
from baton_openai.batch.store import line_result_id
from baton_openai.http.app import build_app

log = logging.getLogger("baton_openai")

#: Lines in the engine at once by default: enough to fill its batch (scheduler.max_num_seqs).
DEFAULT_CONCURRENCY = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL) to run")
    p.add_argument("-o", "--output-file", required=True, help="where to write the results (JSONL)")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"most lines in the engine at once (default {DEFAULT_CONCURRENCY})",
    )
    add_engine_arguments(p)


async def run_lines(runner: LineRunner, data: bytes, concurrency: int) -> list[ResultLine]:
    """Every line's result, in input order. EngineGone when the engine dies."""
    slots = asyncio.Semaphore(concurrency)

    async def one(index: int, raw: bytes) -> ResultLine:
        rid = line_result_id(index)
        try:
            line = parse_line(raw, None)
        except LineRejected as e:
            return rejected_line(rid, raw, e)
        async with slots:
            response, ok = await runner.run(line)
        return result_line(rid, line.custom_id, response, ok)

    return list(await asyncio.gather(*(one(i, raw) for i, raw in input_lines(data))))


async def run_batch_file(
    config: BatonConfig, input_file: Path, output_file: Path, concurrency: int
) -> list[ResultLine]:
    """Run ``input_file``'s lines on a fresh engine and write ``output_file``."""
    data = input_file.read_bytes()
    engine = await AsyncLLM.create(config=config)
    app = None
    try:
        app = build_app(engine, config)
        results = await run_lines(LineRunner(app, priority=0), data, concurrency)
    finally:
        if app is not None:
            await app.state.baton.preprocess.aclose()
        engine.shutdown()
    write_atomic(output_file, b"".join(msgspec.json.encode(r) + b"\n" for r in results))
    return results


def main(args: argparse.Namespace) -> int:
    if args.max_concurrency < 1:
        print(f"--max-concurrency must be >= 1, got {args.max_concurrency}", file=sys.stderr)
        return 2
    config = BatonConfig.load(args.config, **engine_overrides(args))
    src, dst = Path(args.input_file), Path(args.output_file)
    if not src.is_file():
        print(f"baton run-batch: no input file {str(src)!r}", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(run_batch_file(config, src, dst, args.max_concurrency))
    except EngineGone as e:
        print(f"baton run-batch: the engine stopped: {e}; {dst} not written", file=sys.stderr)
        return 1
    failed = sum(1 for r in results if r.error is not None)
    print(
        f"baton run-batch: {len(results)} lines, {len(results) - failed} succeeded, "
        f"{failed} failed -> {dst}",
        file=sys.stderr,
    )
    return 0
