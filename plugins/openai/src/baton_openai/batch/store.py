"""The Batch API's state on disk: one record per batch, and its results, which say what is done.

``<files_dir>/batches/<id>.json`` is the batch's record (msgspec), rewritten
whole on each status change (``write_atomic``). Which lines are done is not in
the record: it is the results themselves. Each finished line is one JSON line
appended to the batch's output or error file (``ResultLog``) and fsynced; its
``id`` ends with the line's index (``batch_req_<hex>_<index>``). On a restart
``ResultLog.recover`` cuts a torn last line and reads back the indexes, and the
runner skips them.

The crash window, so that each line is in the results exactly once: a line
killed before its result is durable has no result line (or a torn one, which
is cut) and runs again; a line whose result is durable is never run again. A
line may thus run twice in the engine across a crash, but it is written once.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import msgspec

from baton_openai.batch.file_store import write_atomic
from baton_openai.http.errors import OpenAIError

Status = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
#: Statuses a batch leaves no more.
FINAL: tuple[Status, ...] = ("failed", "completed", "expired", "cancelled")
_ID = re.compile(r"batch_[0-9a-f]{32}")
_INDEX = re.compile(rb'"id":"batch_req_[0-9a-f]+_([0-9]+)"')


class RequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct):
    """Why a batch failed as a whole (its input file could not be read, ...)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct):
    data: list[BatchError]
    object: str = "list"


class BatchRecord(msgspec.Struct, kw_only=True):
    """OpenAI's batch object, plus the ids its output and error files get when it ends."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Status
    created_at: int
    expires_at: int
    #: The files the results are appended to, listed (output_file_id, error_file_id) at the end.
    output_path_id: str
    error_path_id: str
    object: str = "batch"
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None

    def set_status(self, status: Status) -> None:
        """The new status and its timestamp (``<status>_at``)."""
        self.status = status
        stamp = f"{status}_at"
        if stamp in self.__struct_fields__:
            setattr(self, stamp, int(time.time()))

    def api_view(self) -> dict[str, Any]:
        """The batch as the API shows it (without the result paths)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out.pop("output_path_id")
        out.pop("error_path_id")
        return out


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def line_result_id(index: int) -> str:
    """A result line's id: unique, and naming the input line it answers (for recovery)."""
    return f"batch_req_{uuid.uuid4().hex[:24]}_{index}"


class BatchStore:
    """Batch records in ``<root>/batches``; blocking I/O (call it off the event loop)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, rec: BatchRecord) -> None:
        write_atomic(self.dir / f"{rec.id}.json", msgspec.json.encode(rec))

    def load_all(self) -> list[BatchRecord]:
        """Every batch on disk, oldest first."""
        out = [
            msgspec.json.decode(p.read_bytes(), type=BatchRecord)
            for p in self.dir.glob("batch_*.json")
        ]
        out.sort(key=lambda r: (r.created_at, r.id))
        return out


def checked_batch_id(batch_id: str) -> str:
    if not _ID.fullmatch(batch_id):
        raise batch_not_found(batch_id)
    return batch_id


def batch_not_found(batch_id: str) -> OpenAIError:
    shown = batch_id if len(batch_id) <= 64 else batch_id[:64] + "..."
    return OpenAIError(f"No such batch: {shown!r}", 404, param="batch_id", code="batch_not_found")


class ResultLog:
    """A batch's output or error file: JSON lines appended, each durable before it counts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.touch(exist_ok=True)

    def recover(self) -> set[int]:
        """The input lines answered here; a torn last line (a crash mid-write) is cut off."""
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.path, "rb+") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        done = set()
        for line in data[:end].splitlines():
            m = _INDEX.search(line)
            if m is not None:
                done.add(int(m.group(1)))
        return done

    def append(self, line: bytes) -> None:
        """One result line, on disk (fsynced) when this returns."""
        with open(self.path, "ab") as f:
            f.write(line + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
