"""The hand-off store: one folder per hand-off, one checksummed file per block and shard.

Layout: ``<path>/<namespace key>/<transfer id>/<block index>-<block hash>-tp<r>-pp<s>.kv``.
A file is written to a temporary name and renamed into place (a reader sees a whole file or
none); its header holds the payload's length and blake2b digest, so a truncated or corrupt
file is refused, never loaded. The consumer removes a hand-off's folder once it has loaded it;
producers remove the hand-offs no consumer took after ``max_age`` seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import time
from pathlib import Path

from baton.errors import BatonError

_MAGIC = b"BATONPD1"
_HEADER = struct.Struct("<8sQ16s")  # magic, payload length, blake2b-128 of the payload


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class BadBlockError(BatonError):
    """A block file is truncated or fails its checksum: its tokens are recomputed."""


class HandoffStore:
    """Block files of hand-offs under one namespace folder (``namespace_key``)."""

    def __init__(self, path: str | os.PathLike[str], namespace_key: str, shard: str) -> None:
        self.root = Path(path) / namespace_key
        self.shard = shard  # "tp<r>-pp<s>": a worker reads and writes its own shard only

    def folder(self, transfer_id: str) -> Path:
        return self.root / transfer_id

    def block_path(self, transfer_id: str, index: int, block_hash: bytes) -> Path:
        return self.folder(transfer_id) / f"{index}-{block_hash.hex()}-{self.shard}.kv"

    def write(self, transfer_id: str, index: int, block_hash: bytes, payload: bytes) -> int:
        """Write one block (atomically); returns the bytes written."""
        final = self.block_path(transfer_id, index, block_hash)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        header = _HEADER.pack(_MAGIC, len(payload), _digest(payload))
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)
        return len(header) + len(payload)

    def read(self, transfer_id: str, index: int, block_hash: bytes, size: int) -> bytes | None:
        """One block's payload of ``size`` bytes; None when it is not there (yet). Raises
        BadBlockError for a truncated or corrupt file (recomputed, never served)."""
        path = self.block_path(transfer_id, index, block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) != _HEADER.size + size:
            raise BadBlockError(f"{path} holds {len(data)} bytes, not {_HEADER.size + size}")
        magic, length, digest = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != _MAGIC or length != size or _digest(payload) != digest:
            raise BadBlockError(f"{path} fails its checksum")
        return payload

    def remove_shard(self, transfer_id: str) -> None:
        """Drop this shard's files of a hand-off, and its folder once no shard has any left
        (other workers of a tensor-parallel consumer may still be loading theirs)."""
        folder = self.folder(transfer_id)
        for path in folder.glob(f"*-{self.shard}.kv"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty (another shard's files) or gone
            folder.rmdir()

    def sweep(self, max_age: float, now: float | None = None) -> int:
        """Remove hand-offs untouched for ``max_age`` seconds; returns how many."""
        cutoff = (time.time() if now is None else now) - max_age
        removed = 0
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                stale = entry.is_dir() and entry.stat().st_mtime < cutoff
            except FileNotFoundError:  # a consumer removed it meanwhile
                continue
            if stale:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
        return removed
