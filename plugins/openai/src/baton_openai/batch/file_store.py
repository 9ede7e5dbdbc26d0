"""The Files API's storage: uploaded and produced files under ``server.files_dir``.

A file is two entries in ``<files_dir>/files``: ``<id>.data`` (its bytes) and
``<id>.json`` (its FileObject, msgspec). The metadata is written last, each
entry whole (temp file, fsync, ``os.replace``): a file exists once its
metadata does, so a crash leaves at most an orphan ``.data`` or temp file,
never a listed file with missing or partial bytes. Batch output files are
written in place under a reserved id and published when the batch finishes.

Ids are checked against their pattern before they touch a path, so a client's
id cannot name anything outside the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import msgspec

from baton.errors import ConfigError
from baton_openai.http.errors import OpenAIError

#: What a file is for: uploads are "batch" (input); a batch writes "batch_output" files.
Purpose = Literal["batch", "batch_output"]
#: The upload purposes accepted (others, e.g. fine-tune, have no use here).
UPLOAD_PURPOSES = ("batch",)
_ID = re.compile(r"file-[0-9a-f]{32}")
_COPY_CHUNK = 1 << 20


class FileObject(msgspec.Struct, kw_only=True):
    """OpenAI's file object, also the metadata on disk."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or keeps what it held: temp file, fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@dataclass
class FilesFolder:
    """``server.files_dir``, held by one server (an flock, let go at exit, kill -9 included),
    or a temporary folder removed on close."""

    root: Path
    lock_fd: int
    temporary: bool

    @classmethod
    def open(cls, files_dir: str | None) -> FilesFolder:
        if files_dir is None:
            root, temporary = Path(tempfile.mkdtemp(prefix="baton-files-")), True
        else:
            root, temporary = Path(files_dir).expanduser(), False
            root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"server.files_dir {str(root)!r} is in use by another baton server: give each "
                "server its own folder"
            ) from None
        return cls(root, fd, temporary)

    def close(self) -> None:
        os.close(self.lock_fd)
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)


class FileStore:
    """Files by id in one folder; every method does blocking I/O (call them off the event loop)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def data_path(self, file_id: str) -> Path:
        return self.dir / f"{checked_id(file_id)}.data"

    def _meta_path(self, file_id: str) -> Path:
        return self.dir / f"{checked_id(file_id)}.json"

    def save(self, src: BinaryIO, filename: str, purpose: Purpose) -> FileObject:
        """Copy an upload in (at most ``max_bytes``: a 413 past it) and publish it."""
        file_id = new_file_id()
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{file_id}.", suffix=".tmp")
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := src.read(_COPY_CHUNK):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise OpenAIError(
                            f"the file {filename!r} is over server.max_file_bytes "
                            f"({self.max_bytes} bytes): split it, or raise server.max_file_bytes",
                            413,
                            param="file",
                            code="file_too_large",
                        )
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.data_path(file_id))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return self.publish(file_id, filename, purpose)

    def publish(self, file_id: str, filename: str, purpose: Purpose) -> FileObject:
        """Make the bytes at ``data_path(file_id)`` a listed file (again: the same object)."""
        meta = self._meta_path(file_id)
        if meta.exists():
            return self.get(file_id)
        data = self.data_path(file_id)
        with open(data, "rb+") as f:  # the bytes are durable before the file is listed
            os.fsync(f.fileno())
        obj = FileObject(
            id=file_id,
            bytes=data.stat().st_size,
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        write_atomic(meta, msgspec.json.encode(obj))
        return obj

    def get(self, file_id: str) -> FileObject:
        try:
            raw = self._meta_path(file_id).read_bytes()
        except FileNotFoundError:
            raise not_found(file_id) from None
        return msgspec.json.decode(raw, type=FileObject)

    def open(self, file_id: str) -> BinaryIO:
        """The file's bytes (404 unless it is listed)."""
        self.get(file_id)
        return open(self.data_path(file_id), "rb")

    def delete(self, file_id: str) -> FileObject:
        obj = self.get(file_id)
        self._meta_path(file_id).unlink()  # unlisted first: no listed file without its bytes
        with contextlib.suppress(FileNotFoundError):
            self.data_path(file_id).unlink()
        return obj

    def list(self, purpose: str | None = None) -> list[FileObject]:
        """Every listed file (of ``purpose``), newest first."""
        out = []
        for meta in self.dir.glob("file-*.json"):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                obj = msgspec.json.decode(meta.read_bytes(), type=FileObject)
                if purpose is None or obj.purpose == purpose:
                    out.append(obj)
        out.sort(key=lambda o: (o.created_at, o.id), reverse=True)
        return out


def checked_id(file_id: str) -> str:
    if not _ID.fullmatch(file_id):
        raise not_found(file_id)
    return file_id


def not_found(file_id: str) -> OpenAIError:
    shown = file_id if len(file_id) <= 64 else file_id[:64] + "..."
    return OpenAIError(f"No such file: {shown!r}", 404, param="file_id", code="file_not_found")
