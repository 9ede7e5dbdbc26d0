"""A single-producer single-consumer ring of fixed slots in shared memory.

Layout of one ring: a control block (four int64 counters, each on its own
cache line) and ``slot_count * slot_size`` data bytes. ``tail`` (slots
published, written only by the writer) and ``head`` (slots consumed, written
only by the reader) only grow; the ring holds ``tail - head`` slots.

A message starts at a slot boundary: a header (u64 total bytes, u32 frame
count, u64 length per frame) followed by the frames' bytes back to back. A
message longer than one slot runs on through the following slots; one longer
than the whole ring is streamed, the reader freeing slots while the writer
fills them, in steps of at most ``_STEP_BYTES`` so both copy at once.

Memory ordering: the writer stores the payload, then publishes ``tail``; the
reader loads ``tail``, then the payload (x86 keeps stores in order and loads in
order; elsewhere ``fence()`` is called around the publish). Whether to wake
the other side is a flag protocol (set "waiting", fence, re-check / publish,
fence, read "waiting"), which needs a full barrier: ``fence()`` takes and
releases a lock, whose atomic instruction is one.
"""

from __future__ import annotations

import contextlib
import os
import platform
import struct
import threading
from collections.abc import Callable, Sequence

import numpy as np
from baton.errors import TransportError
from baton.interfaces import Frame

# int64 indices into a ring's control block: one cache line (8 int64) each
TAIL, WRITER_WAITING, HEAD, READER_WAITING = 0, 8, 16, 24
CONTROL_BYTES = 256

_HEADER = struct.Struct("<QI4x")
_LENGTHS: dict[int, struct.Struct] = {}
#: Frames this large come back as a memoryview over a fresh numpy buffer (no zeroing); smaller as bytes.
_BIG_FRAME = 65536
#: A long message moves in steps of at most this many bytes, so writer and reader overlap.
_STEP_BYTES = 1 << 20
#: x86 keeps stores (and loads) in order; other CPUs need a barrier around publishing.
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _lengths(n: int) -> struct.Struct:
    s = _LENGTHS.get(n)
    if s is None:
        s = _LENGTHS[n] = struct.Struct(f"<{n}Q")
    return s


def signal(fd: int) -> None:
    """Wake the other side through its FIFO; a full FIFO means it is awake already."""
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"\0")


def data_bytes(slot_size: int, slot_count: int) -> int:
    return slot_size * slot_count


class _Ring:
    def __init__(
        self, control: memoryview, data: memoryview, slot_size: int, slot_count: int
    ) -> None:
        self.ctl = control.cast("q")
        self.data = data
        self.np = np.frombuffer(data, dtype=np.uint8)
        self.slot_size = slot_size
        self.slot_count = slot_count
        self.max_frames = (slot_size - _HEADER.size) // 8
        self._fence_lock = threading.Lock()

    def fence(self) -> None:
        """A full memory barrier (the lock's atomic instruction), as seen from Python."""
        self._fence_lock.acquire()
        self._fence_lock.release()

    def release(self) -> None:
        """Drop every view into the mapping, so it can be unmapped."""
        self.np = None  # type: ignore[assignment]
        self.ctl.release()
        self.data.release()


class RingWriter(_Ring):
    """The writing end. ``wait_space(ring)`` is called when the ring is full: it returns when
    space may have appeared, or raises TransportError (timeout, reader gone, channel closed)."""

    def __init__(
        self,
        control: memoryview,
        data: memoryview,
        slot_size: int,
        slot_count: int,
        wake_fd: int,
        wait_space: Callable[[RingWriter], None],
    ) -> None:
        super().__init__(control, data, slot_size, slot_count)
        self._wake_fd = wake_fd  # the reader's data FIFO
        self._wait_space = wait_space
        self._tail = self.ctl[TAIL]
        self._head = self.ctl[HEAD]

    def free_slots(self) -> int:
        self._head = self.ctl[HEAD]
        return self.slot_count - (self._tail - self._head)

    def write(self, frames: Sequence[Frame]) -> None:
        n = len(frames)
        if not n:
            raise TransportError("cannot send an empty message: a message needs at least one frame")
        if n > self.max_frames:
            raise TransportError(
                f"a message of {n} frames exceeds the shm slot's {self.max_frames}: raise slot_size"
            )
        views = [
            f.cast("B") if type(f) is memoryview and (f.ndim != 1 or f.format != "B") else f
            for f in frames
        ]
        sizes = [v.nbytes if type(v) is memoryview else len(v) for v in views]
        hlen = _HEADER.size + 8 * n
        total = hlen + sum(sizes)
        if total > self.slot_size:
            self._write_long(views, sizes, hlen, total)
            return
        while self.slot_count - (self._tail - self._head) < 1 and self.free_slots() < 1:
            self._wait_space(self)
        off = (self._tail % self.slot_count) * self.slot_size
        data = self.data
        _HEADER.pack_into(data, off, total, n)
        _lengths(n).pack_into(data, off + _HEADER.size, *sizes)
        p = off + hlen
        for view, size in zip(views, sizes, strict=True):
            data[p : p + size] = view
            p += size
        self._publish(self._tail + 1)

    def _write_long(self, views: list, sizes: list[int], hlen: int, total: int) -> None:
        header = bytearray(hlen)
        _HEADER.pack_into(header, 0, total, len(views))
        _lengths(len(views)).pack_into(header, _HEADER.size, *sizes)
        sources = [np.frombuffer(header, np.uint8)] + [np.frombuffer(v, np.uint8) for v in views]
        src, src_off = 0, 0
        ss, count = self.slot_size, self.slot_count
        step_slots = max(1, _STEP_BYTES // ss)
        pos = 0
        while pos < total:
            free = self.slot_count - (self._tail - self._head)
            if free < 1:
                free = self.free_slots()
                if free < 1:
                    self._wait_space(self)
                    continue
            slot = self._tail % count
            nslots = min(free, count - slot, -(-(total - pos) // ss), step_slots)
            nbytes = min(nslots * ss, total - pos)
            dst, dst_off, end = self.np, slot * ss, slot * ss + nbytes
            while dst_off < end:  # gather the sources into this run of slots
                source = sources[src]
                take = min(source.size - src_off, end - dst_off)
                dst[dst_off : dst_off + take] = source[src_off : src_off + take]
                dst_off += take
                src_off += take
                if src_off == source.size:
                    src, src_off = src + 1, 0
                    while src < len(sources) and sources[src].size == 0:
                        src += 1
            pos += nbytes
            self._publish(self._tail + nslots)

    def _publish(self, tail: int) -> None:
        if not _TSO:
            self.fence()  # release: the payload before the counter
        self.ctl[TAIL] = self._tail = tail
        self.fence()  # the counter before reading the reader's flag (store -> load)
        if self.ctl[READER_WAITING]:
            signal(self._wake_fd)


class RingReader(_Ring):
    """The reading end. ``wait_more(ring)`` is called mid-message when the rest has not been
    written yet: it returns when more may have arrived, or raises TransportError."""

    def __init__(
        self,
        control: memoryview,
        data: memoryview,
        slot_size: int,
        slot_count: int,
        wake_fd: int,
        wait_more: Callable[[RingReader], None],
    ) -> None:
        super().__init__(control, data, slot_size, slot_count)
        self._wake_fd = wake_fd  # the writer's space FIFO
        self._wait_more = wait_more
        self._head = self.ctl[HEAD]
        self._tail = self.ctl[TAIL]

    def ready(self) -> bool:
        """A message (or its start) is waiting."""
        if self._tail == self._head:
            self._tail = self.ctl[TAIL]
            if not _TSO:
                self.fence()  # acquire: the counter before the payload
        return self._tail != self._head

    def read(self) -> list[Frame] | None:
        if not self.ready():
            return None
        ss = self.slot_size
        off = (self._head % self.slot_count) * ss
        total, n = _HEADER.unpack_from(self.data, off)
        if n < 1 or n > self.max_frames:
            raise TransportError(f"shm ring is corrupt: message header says {n} frames")
        sizes = _lengths(n).unpack_from(self.data, off + _HEADER.size)
        hlen = _HEADER.size + 8 * n
        if total != hlen + sum(sizes):
            raise TransportError(
                f"shm ring is corrupt: header says {total} bytes, frames add up to {hlen + sum(sizes)}"
            )
        if total > ss:
            return self._read_long(sizes, hlen, total)
        data = self.data
        frames: list[Frame] = []
        p = off + hlen
        for size in sizes:
            frames.append(data[p : p + size].tobytes())
            p += size
        self._release(self._head + 1)
        return frames

    def _read_long(self, sizes: tuple[int, ...], hlen: int, total: int) -> list[Frame]:
        buffers = [np.empty(s, np.uint8) if s >= _BIG_FRAME else bytearray(s) for s in sizes]
        dests = [b if isinstance(b, np.ndarray) else np.frombuffer(b, np.uint8) for b in buffers]
        dst, dst_off = 0, 0
        while dst < len(dests) and dests[dst].size == 0:
            dst += 1
        ss, count = self.slot_size, self.slot_count
        step_slots = max(1, _STEP_BYTES // ss)
        pos, skip = 0, hlen
        while pos < total:
            avail = self._tail - self._head
            if avail < 1:
                if not self.ready():
                    self._wait_more(self)
                    continue
                avail = self._tail - self._head
            slot = self._head % count
            nslots = min(avail, count - slot, -(-(total - pos) // ss), step_slots)
            nbytes = min(nslots * ss, total - pos)
            src, src_off, end = self.np, slot * ss + skip, slot * ss + nbytes
            while src_off < end:  # scatter this run of slots into the frames
                dest = dests[dst]
                take = min(dest.size - dst_off, end - src_off)
                dest[dst_off : dst_off + take] = src[src_off : src_off + take]
                src_off += take
                dst_off += take
                if dst_off == dest.size:
                    dst, dst_off = dst + 1, 0
                    while dst < len(dests) and dests[dst].size == 0:
                        dst += 1
            pos += nbytes
            skip = 0
            self._release(self._head + nslots)
        return [memoryview(b) if isinstance(b, np.ndarray) else bytes(b) for b in buffers]

    def _release(self, head: int) -> None:
        self.ctl[HEAD] = self._head = head
        self.fence()  # the counter before reading the writer's flag (store -> load)
        if self.ctl[WRITER_WAITING]:
            signal(self._wake_fd)
