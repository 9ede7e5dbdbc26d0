"""The batch worker: runs each batch's lines, a bounded number at a time, and resumes after a restart.

A batch goes validating -> in_progress -> finalizing -> completed (or failed:
its input file cannot be read; cancelling -> cancelled; expired: its 24 h
window passed, the lines left undone go to the error file). Each line is
parsed (a malformed one goes to the error file), run through the endpoint's
handler (``LineRunner``) and its result appended, durably, to the output file
(status 200) or the error file (``ResultLog``). At most
``server.batch_max_concurrency`` lines of all batches are in flight at once,
so a batch never floods the engine; and they run at ``server.batch_priority``.

On start, every batch not in a final status is resumed: the lines already in
its output and error files are skipped (batch/store.py says why each line is
then written exactly once). On stop, the lines in flight are cancelled (their
engine requests aborted) and nothing is written for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec

from baton_openai.batch.file_store import FilesFolder, FileStore, new_file_id
from baton_openai.batch.lines import (
    ENDPOINTS,
    BatchLine,
    EngineGone,
    LineRejected,
    LineRunner,
    ResultLine,
    parse_line,
    rejected_line,
    result_line,
)
from baton_openai.batch.store import (
    FINAL,
    BatchError,
    BatchErrors,
    BatchRecord,
    BatchStore,
    ResultLog,
    Status,
    batch_not_found,
    checked_batch_id,
    line_result_id,
    new_batch_id,
)
from baton_openai.http.errors import OpenAIError

log = logging.getLogger("baton_openai")

#: The one completion window (OpenAI's).
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
#: Most lines one batch may have (OpenAI's limit).
MAX_BATCH_LINES = 50_000


def input_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The input file's request lines with their indexes (blank lines are not requests)."""
    index = 0
    for raw in data.splitlines():
        if raw.strip():
            yield index, raw
            index += 1


class BatchFailed(Exception):
    """The batch cannot run at all (its input file is unreadable or empty)."""

    def __init__(self, error: BatchError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class _Results:
    """One running batch's output and error files, written one line at a time, and the input
    lines they answer."""

    output: ResultLog
    error: ResultLog
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Indexes of the lines answered (in either file), and of those in the output file.
    answered: set[int] = field(default_factory=set)
    ok: set[int] = field(default_factory=set)

    def recover(self) -> None:
        """What the files already answer (blocking: call it off the event loop)."""
        self.ok = self.output.recover()
        self.answered = self.ok | self.error.recover()

    async def add(self, rec: BatchRecord, index: int, line: ResultLine, ok: bool = False) -> None:
        """Append ``line`` (to the output file when ``ok``), durably, then count it; a line
        already answered is not written again. Once begun, this finishes even if the caller
        is cancelled (so the counts always match the files)."""
        await asyncio.shield(self._add(rec, index, line, ok))

    async def _add(self, rec: BatchRecord, index: int, line: ResultLine, ok: bool) -> None:
        data = msgspec.json.encode(line)
        async with self.lock:  # one writer at a time: lines are never interleaved
            if index in self.answered:
                return
            await asyncio.to_thread((self.output if ok else self.error).append, data)
            self.answered.add(index)
            if ok:
                self.ok.add(index)
                rec.request_counts.completed += 1
            else:
                rec.request_counts.failed += 1


@dataclass
class _Storage:
    """Where a started runner keeps files and batches."""

    folder: FilesFolder
    files: FileStore
    store: BatchStore


class BatchRunner:
    """Every batch of a server: created, listed, cancelled, run, resumed; and its files."""

    def __init__(
        self,
        lines: LineRunner,
        *,
        files_dir: str | None,
        max_file_bytes: int,
        max_concurrency: int,
    ) -> None:
        self.lines = lines
        self.files_dir = files_dir
        self.max_file_bytes = max_file_bytes
        self.max_concurrency = max_concurrency
        self.batches: dict[str, BatchRecord] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(max_concurrency)
        self._storage: _Storage | None = None

    def _started(self) -> _Storage:
        if self._storage is None:
            raise OpenAIError(
                "the Files and Batch APIs are not started (the server is starting or stopping)",
                503,
                code="service_unavailable",
            )
        return self._storage

    @property
    def files(self) -> FileStore:
        return self._started().files

    @property
    def store(self) -> BatchStore:
        return self._started().store

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Take the folder (ConfigError when another server holds it), load every batch and
        resume the unfinished ones."""
        folder = await asyncio.to_thread(FilesFolder.open, self.files_dir)
        store = BatchStore(folder.root)
        self._storage = _Storage(folder, FileStore(folder.root, self.max_file_bytes), store)
        for rec in await asyncio.to_thread(store.load_all):
            self.batches[rec.id] = rec
            if rec.status not in FINAL:
                log.info("resuming batch %s (%s)", rec.id, rec.status)
                self._spawn(rec)

    async def stop(self) -> None:
        """Cancel the lines in flight (nothing is written for them; the batches stay resumable)
        and let the folder go."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        storage, self._storage = self._storage, None
        if storage is not None:
            await asyncio.to_thread(storage.folder.close)

    def _spawn(self, rec: BatchRecord) -> None:
        task = asyncio.ensure_future(self._run(rec))
        self._tasks[rec.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(rec.id, None))

    # ------------------------------------------------------------------ the API's operations

    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> BatchRecord:
        if endpoint not in ENDPOINTS:
            raise OpenAIError(
                f"endpoint {endpoint!r} is not one of {', '.join(ENDPOINTS)}",
                param="endpoint",
                code="invalid_value",
            )
        if completion_window not in COMPLETION_WINDOW_S:
            raise OpenAIError(
                f"completion_window must be one of {', '.join(COMPLETION_WINDOW_S)}, "
                f"got {completion_window!r}",
                param="completion_window",
                code="invalid_value",
            )
        src = await asyncio.to_thread(self.files.get, input_file_id)
        if src.purpose != "batch":
            raise OpenAIError(
                f"file {input_file_id} has purpose {src.purpose!r}: upload the input with "
                "purpose 'batch'",
                param="input_file_id",
                code="invalid_value",
            )
        now = int(time.time())
        rec = BatchRecord(
            id=new_batch_id(),
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_S[completion_window],
            output_path_id=new_file_id(),
            error_path_id=new_file_id(),
            metadata=metadata,
        )
        await asyncio.to_thread(self.store.save, rec)
        self.batches[rec.id] = rec
        self._spawn(rec)
        return rec

    def get(self, batch_id: str) -> BatchRecord:
        rec = self.batches.get(checked_batch_id(batch_id))
        if rec is None:
            raise batch_not_found(batch_id)
        return rec

    def list(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        return sorted(self.batches.values(), key=lambda r: (r.created_at, r.id), reverse=True)

    async def cancel(self, batch_id: str) -> BatchRecord:
        rec = self.get(batch_id)
        if rec.status in ("cancelling", "cancelled", "finalizing"):
            return rec  # finalizing: every line is answered, the batch completes
        if rec.status in FINAL:
            raise OpenAIError(
                f"batch {batch_id} is {rec.status}: only a batch in progress can be cancelled",
                param="batch_id",
                code="invalid_value",
            )
        rec.set_status("cancelling")
        await asyncio.to_thread(self.store.save, rec)
        task = self._tasks.get(rec.id)
        if task is not None:
            task.cancel()  # the lines in flight are aborted; _run finishes the cancellation
        else:
            self._spawn(rec)
        return rec

    def in_use(self, file_id: str) -> bool:
        """Whether an unfinished batch reads ``file_id``."""
        return any(
            r.input_file_id == file_id and r.status not in FINAL for r in self.batches.values()
        )

    # ------------------------------------------------------------------ the work

    async def _run(self, rec: BatchRecord) -> None:
        results = _Results(
            ResultLog(self.files.data_path(rec.output_path_id)),
            ResultLog(self.files.data_path(rec.error_path_id)),
        )
        final: Status = "cancelled"
        try:
            if rec.status != "cancelling":
                final = await self._work(rec, results)
        except asyncio.CancelledError:
            if rec.status != "cancelling":  # the server is stopping: resumed at the next start
                async with results.lock:  # after the writes already begun
                    pass
                raise
        except EngineGone as e:
            log.warning("batch %s paused: %s (it resumes when the server restarts)", rec.id, e)
            return
        except BatchFailed as e:
            log.warning("batch %s failed: %s", rec.id, e.error.message)
            rec.errors = BatchErrors([e.error])
            rec.set_status("failed")
            await asyncio.to_thread(self.store.save, rec)
            return
        async with results.lock:  # the writes begun before a cancellation are in
            await self._finish(rec, final)

    async def _work(self, rec: BatchRecord, results: _Results) -> Status:
        """Run the lines not answered yet; the status the batch ends with."""
        lines = await asyncio.to_thread(self._read_input, rec)
        await asyncio.to_thread(results.recover)
        rec.request_counts.total = len(lines)
        rec.request_counts.completed = len(results.ok)
        rec.request_counts.failed = len(results.answered) - len(results.ok)
        if rec.status == "validating":
            rec.set_status("in_progress")
            await asyncio.to_thread(self.store.save, rec)
        assert self._slots is not None
        slots = self._slots
        running: set[asyncio.Task[None]] = set()
        seen: dict[str, int] = {}
        failures: list[BaseException] = []

        def finished(task: asyncio.Task[None]) -> None:
            running.discard(task)
            slots.release()
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())  # type: ignore[arg-type]

        def left() -> float:  # seconds of the completion window
            return max(rec.expires_at - time.time(), 0.0)

        try:
            for index, raw in lines:
                try:
                    line = parse_line(raw, rec.endpoint)
                    first = seen.setdefault(line.custom_id, index)
                    if first != index:
                        raise LineRejected(
                            "duplicate_custom_id",
                            f"custom_id {line.custom_id!r} is also line {first}'s: make each "
                            "custom_id unique in the batch",
                        )
                except LineRejected as e:
                    await results.add(rec, index, rejected_line(line_result_id(index), raw, e))
                    continue
                if index in results.answered:
                    continue
                try:
                    await asyncio.wait_for(slots.acquire(), left())
                except TimeoutError:
                    break  # the window ended while every slot was busy
                if failures:
                    slots.release()
                    raise failures[0]  # EngineGone: stop dispatching
                task = asyncio.ensure_future(self._line(rec, results, index, line))
                running.add(task)
                task.add_done_callback(finished)
            else:
                if running:
                    await asyncio.wait(set(running), timeout=left())
                if failures:
                    raise failures[0]
                if not running:
                    return "completed"
        finally:
            for t in running:
                t.cancel()  # their engine requests are aborted; nothing is written for them
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        # past the completion window: what is left is answered as expired
        expired = LineRejected(
            "batch_expired", "the batch's completion window ended before this line ran"
        )
        for index, raw in lines:
            await results.add(rec, index, rejected_line(line_result_id(index), raw, expired))
        return "expired"

    async def _line(self, rec: BatchRecord, results: _Results, index: int, line: BatchLine) -> None:
        response, ok = await self.lines.run(line)
        await results.add(
            rec, index, result_line(line_result_id(index), line.custom_id, response, ok), ok
        )

    def _read_input(self, rec: BatchRecord) -> list[tuple[int, bytes]]:
        """The input's request lines (BatchFailed when it cannot be read or has none, or too many)."""
        try:
            with self.files.open(rec.input_file_id) as f:
                lines = list(input_lines(f.read()))
        except (OSError, OpenAIError) as e:
            raise BatchFailed(
                BatchError(
                    "file_unreadable", f"the input file cannot be read: {e}", "input_file_id"
                )
            ) from None
        if not 0 < len(lines) <= MAX_BATCH_LINES:
            raise BatchFailed(
                BatchError(
                    "invalid_input_file",
                    f"the input file has {len(lines)} request lines: give 1 to {MAX_BATCH_LINES}",
                    "input_file_id",
                )
            )
        return lines

    async def _finish(self, rec: BatchRecord, final: Status) -> None:
        """Publish the output and error files (again, after a crash: idempotent), then the
        final status."""
        if rec.status != "cancelling":
            rec.set_status("finalizing")
        for path_id, attr, name in (
            (rec.output_path_id, "output_file_id", "output"),
            (rec.error_path_id, "error_file_id", "error"),
        ):
            path = self.files.data_path(path_id)
            if path.exists() and path.stat().st_size > 0:
                obj = await asyncio.to_thread(
                    self.files.publish, path_id, f"{rec.id}_{name}.jsonl", "batch_output"
                )
                setattr(rec, attr, obj.id)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        rec.set_status(final)
        await asyncio.to_thread(self.store.save, rec)
        log.info(
            "batch %s %s: %d completed, %d failed",
            rec.id,
            rec.status,
            rec.request_counts.completed,
            rec.request_counts.failed,
        )
