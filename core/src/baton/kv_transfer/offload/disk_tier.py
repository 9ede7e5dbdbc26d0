"""The disk tier: one checked file per KV block, in a directory several engines may share.

``BlockFileStore`` knows nothing of the connector halves (the offload connector uses it for its
disk tier, a prefill/decode connector may use it over ``/dev/shm``). A block is a tensor stored
as ``<root>/<namespace key>/<block hash hex>.kvb``: a fixed prefix (magic, format version,
header length), a msgpack header (namespace key, block hash, shape, dtype, payload length,
blake2b of the payload), then the payload. Writes go to a temporary file in the same directory
and are renamed into place (``os.replace``: a reader sees the whole old file, the whole new one
or none, never a torn one). Reads check everything; a file that fails a check is deleted and
reported as a miss (``failed_loads``), so its block is recomputed, never served.

The byte budget covers the whole root (every namespace, every engine): past it, the least
recently used files (by modification time, which a read refreshes) are deleted. A full disk
(``ENOSPC``, or a budget that eviction cannot meet) stops storing, with one warning.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import struct
import tempfile
import threading
from pathlib import Path

import msgspec
import torch

log = logging.getLogger(__name__)

MAGIC = b"BATONKV\x00"
VERSION = 1
SUFFIX = ".kvb"
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
_MAX_HEADER = 1 << 16
#: After an eviction pass the store is at most this share of its budget, so a full store
#: does not rescan the directory for every write.
_LOW_WATERMARK = 0.9
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class BlockFileHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What a block file says about its payload (all checked when read)."""

    namespace_key: str
    block_hash: bytes
    shape: list[int]
    dtype: str  # a torch dtype name, e.g. "float32"
    payload_nbytes: int
    checksum: bytes  # blake2b (16 bytes) of the payload


_encode_header = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(BlockFileHeader).decode


def _checksum(payload: memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is a contiguous CPU tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class BlockFileStore:
    """KV blocks as files under ``root/namespace_key``; ``capacity_bytes`` bounds all of
    ``root``. Thread-safe; several processes may open the same root."""

    def __init__(
        self, root: str | os.PathLike[str], capacity_bytes: int, namespace_key: str
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: must be > 0")
        if not namespace_key or "/" in namespace_key or namespace_key.startswith("."):
            raise ValueError(f"namespace_key={namespace_key!r}: must be a plain, non-empty name")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.namespace_key = namespace_key
        self.dir = self.root / namespace_key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.full = False  # storing stopped (disk full); loads still work
        self.failed_loads = 0  # files found bad (deleted) since the store opened
        self._lock = threading.Lock()
        self._used = self._scan()[0]  # an estimate between scans (other engines write too)

    # ---- paths and scanning

    def path_of(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def __contains__(self, block_hash: object) -> bool:
        """Whether a file for the block exists (not checked: a bad one reads as a miss)."""
        return isinstance(block_hash, bytes) and self.path_of(block_hash).is_file()

    @property
    def used_bytes(self) -> int:
        """Bytes of block files under the root, as last counted (plus this store's writes)."""
        return self._used

    def _scan(self) -> tuple[int, list[tuple[float, int, Path]]]:
        """All block files under the root: total bytes and (mtime, size, path) of each."""
        files: list[tuple[float, int, Path]] = []
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                if not name.endswith(SUFFIX):
                    continue
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                except FileNotFoundError:  # deleted meanwhile by another engine
                    continue
                files.append((st.st_mtime, st.st_size, path))
                total += st.st_size
        return total, files

    # ---- writing

    def put(self, block_hash: bytes, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` as the block's file (replacing any); whether it was stored (False:
        the store is full, or the block alone exceeds the budget)."""
        if self.full:
            return False
        payload = _as_bytes(tensor)
        header = _encode_header(
            BlockFileHeader(
                namespace_key=self.namespace_key,
                block_hash=block_hash,
                shape=list(tensor.shape),
                dtype=_dtype_name(tensor.dtype),
                payload_nbytes=payload.nbytes,
                checksum=_checksum(payload),
            )
        )
        size = _PREFIX.size + len(header) + payload.nbytes
        with self._lock:
            fits = self._make_room(size)
            if fits:
                self._used += size
        if not fits:
            self._stop(
                f"the disk tier at {self.root} cannot fit a {size}-byte block in its budget of "
                f"{self.capacity_bytes} bytes: raise disk_memory"
            )
            return False
        try:
            self._write(block_hash, header, payload)
        except OSError as exc:
            with self._lock:
                self._used -= size
            if exc.errno in _FULL_ERRNOS:
                self._stop(
                    f"the disk tier at {self.root} is full ({exc}): free space or lower disk_memory"
                )
                return False
            raise
        return True

    def _write(self, block_hash: bytes, header: bytes, payload: memoryview) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path_of(block_hash))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _make_room(self, size: int) -> bool:
        """Delete least recently used files until ``size`` more bytes fit; whether they do.
        Called with the lock held."""
        if size > self.capacity_bytes:
            return False
        if self._used + size <= self.capacity_bytes:
            return True
        total, files = self._scan()  # the truth, other engines' files included
        target = min(self.capacity_bytes - size, int(self.capacity_bytes * _LOW_WATERMARK))
        files.sort()
        for _, fsize, path in files:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):  # another engine evicted it first
                path.unlink()
            total -= fsize
        self._used = total
        return total + size <= self.capacity_bytes

    def _stop(self, message: str) -> None:
        with self._lock:
            if self.full:
                return
            self.full = True
        log.warning("%s; storing stops (blocks already stored are still read)", message)

    # ---- reading

    def get(
        self,
        block_hash: bytes,
        shape: list[int] | tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor | None:
        """The block's tensor, or None if it has no file or its file fails a check (then the
        file is deleted and ``failed_loads`` counts it). ``shape`` / ``dtype``: what the caller
        expects (a file with another is bad)."""
        path = self.path_of(block_hash)
        try:
            with open(path, "rb") as f:
                tensor, problem = self._read(f, block_hash, shape, dtype)
        except FileNotFoundError:
            return None
        if problem is not None:
            self._discard(path, problem)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # recently used: the last to be evicted
        return tensor

    def _read(
        self,
        f: object,
        block_hash: bytes,
        shape: list[int] | tuple[int, ...] | None,
        dtype: torch.dtype | None,
    ) -> tuple[torch.Tensor | None, str | None]:
        """The tensor of an open block file, or why it is bad."""
        read = f.read  # type: ignore[attr-defined]
        prefix = read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            return None, "truncated prefix"
        magic, version, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC or version != VERSION:
            return None, f"not a version-{VERSION} block file"
        if header_len > _MAX_HEADER:
            return None, "header too long"
        raw = read(header_len)
        if len(raw) < header_len:
            return None, "truncated header"
        try:
            header = _decode_header(raw)
        except msgspec.DecodeError as exc:
            return None, f"bad header ({exc})"
        if header.namespace_key != self.namespace_key or header.block_hash != block_hash:
            return None, "written for another namespace or block"
        if shape is not None and list(shape) != header.shape:
            return None, f"shape {header.shape}, expected {list(shape)}"
        if dtype is not None and _dtype_name(dtype) != header.dtype:
            return None, f"dtype {header.dtype}, expected {_dtype_name(dtype)}"
        try:
            file_dtype = getattr(torch, header.dtype)
        except AttributeError:
            return None, f"unknown dtype {header.dtype!r}"
        if not isinstance(file_dtype, torch.dtype):
            return None, f"unknown dtype {header.dtype!r}"
        numel = 1
        for n in header.shape:
            numel *= n
        if numel * file_dtype.itemsize != header.payload_nbytes:
            return None, "payload length does not match its shape"
        buf = torch.empty(header.payload_nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")
        got = f.readinto(view)  # type: ignore[attr-defined]
        if got != header.payload_nbytes:
            return None, "truncated payload"
        if read(1):
            return None, "trailing bytes"
        if _checksum(view) != header.checksum:
            return None, "checksum mismatch"
        return buf.view(file_dtype).reshape(header.shape), None

    def _discard(self, path: Path, problem: str) -> None:
        with self._lock:
            self.failed_loads += 1
        log.warning("KV block file %s is bad (%s): deleted; its block is recomputed", path, problem)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self._used = max(0, self._used - size)

    def remove(self, block_hash: bytes) -> bool:
        """Delete the block's file; whether there was one."""
        path = self.path_of(block_hash)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return False
        with self._lock:
            self._used = max(0, self._used - size)
        return True
