"""A single-producer single-consumer ring of fixed slots in shared memory.

Layout of one ring: a control block (four int64 words, each on its own cache
line) and ``slot_count * slot_size`` data bytes. ``tail`` (slots published,
written only by the writer) and ``head`` (slots consumed, written only by the
reader) only grow; the ring holds ``tail - head`` slots.

A message starts at a slot boundary: a header (u64 total bytes, u32 frame
count, u64 length per frame) followed by the frames' bytes back to back. A
message longer than one slot runs on through the following slots; one longer
than the whole ring is streamed, the reader freeing slots while the writer
fills them, in steps of at most ``_STEP_BYTES`` so both copy at once.

Wake-ups: a side that must wait stores in its "waiting" word the counter value
it waits for (reader: "wake me when tail reaches T"; writer: "when head reaches
H") and sleeps on a FIFO; the other side, after moving its counter, writes a
byte to the FIFO only when the counter reached that value. So a busy stream
makes no system calls, and a long message wakes its writer once per quarter
ring rather than once per slot.

Memory ordering: the writer stores the payload, then publishes ``tail``; the
reader loads ``tail``, then the payload (x86 keeps stores in order and loads in
order; elsewhere ``fence()`` is called around the publish). The waiting
protocol (store "waiting", fence, re-check the counter / store the counter,
fence, load "waiting") needs a full barrier: ``fence()`` takes and releases a
lock, whose atomic instruction is one.
"""

from __future__ import annotations

import contextlib
import os
import platform
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from baton.errors import TransportError
from baton.interfaces import Frame
from baton_shm.pool import BufferPool

# int64 indices into a ring's control block: one cache line (8 int64) each
TAIL, WRITER_WAITING, HEAD, READER_WAITING = 0, 8, 16, 24
CONTROL_BYTES = 256

_HEADER = struct.Struct("<QI4x")
_LENGTHS: dict[int, struct.Struct] = {}
_MESSAGE_HEADERS: dict[int, struct.Struct] = {}
_EMPTY = np.empty(0, np.uint8)
#: Frames this large come back as a memoryview over a pooled numpy buffer; smaller ones as bytes.
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


def _message_header(n: int) -> struct.Struct:
    """Header and lengths of an n-frame message, packed in one call."""
    s = _MESSAGE_HEADERS.get(n)
    if s is None:
        s = _MESSAGE_HEADERS[n] = struct.Struct(f"<QI4x{n}Q")
    return s


def _byte_view(frame: Frame) -> memoryview:
    """A flat byte view of any buffer (a copy only for a non-contiguous one)."""
    view = memoryview(frame)
    if view.ndim == 1 and view.format == "B":
        return view
    try:
        return view.cast("B")
    except TypeError:  # not C-contiguous
        return memoryview(view.tobytes())


def signal(fd: int) -> None:
    """Wake the other side through its FIFO; a full FIFO means it is awake already."""
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"\0")


class _Stream:
    """Byte arrays (a message's header and frames) read or written as one stream."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self._i = 0  # the part the next byte is in, and where in it
        self._off = 0

    def copy(self, region: np.ndarray, into_region: bool) -> None:
        """Copy the stream's next ``region.size`` bytes into ``region``, or ``region`` into them."""
        pos, end = 0, region.size
        while pos < end:
            part = self.parts[self._i]
            take = min(part.size - self._off, end - pos)
            if into_region:
                region[pos : pos + take] = part[self._off : self._off + take]
            else:
                part[self._off : self._off + take] = region[pos : pos + take]
            pos += take
            self._off += take
            if self._off == part.size:  # also steps over empty frames
                self._i += 1
                self._off = 0


class _Ring:
    """One end of a ring. ``block(ring)`` sleeps until woken (the channel's: it knows the
    FIFO, the peer and the timeout, and raises TransportError when waiting is hopeless)."""

    def __init__(
        self,
        control: memoryview,
        data: memoryview,
        slot_size: int,
        slot_count: int,
        wake_fd: int,
        block: Callable[[_Ring], None],
    ) -> None:
        self.ctl = control.cast("q")
        self.data = data
        self.np = np.frombuffer(data, dtype=np.uint8)
        self.slot_size = slot_size
        self.slot_count = slot_count
        self.max_frames = (slot_size - _HEADER.size) // 8
        self._wake_fd = wake_fd  # the other side's FIFO
        self._block = block
        self._fence_lock = threading.Lock()
        self._tail = self.ctl[TAIL]
        self._head = self.ctl[HEAD]

    def fence(self) -> None:
        """A full memory barrier (the lock's atomic instruction), as seen from Python."""
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _await(self, flag: int, target: int, enough: Callable[[], bool]) -> None:
        """Sleep until ``enough()``; the other side wakes us once its counter reaches ``target``."""
        while not enough():
            self.ctl[flag] = target
            self.fence()  # our word before re-checking; the other side: its counter before our word
            try:
                if enough():
                    return
                self._block(self)
            finally:
                self.ctl[flag] = 0

    def release(self) -> None:
        """Drop every view into the mapping, so it can be unmapped."""
        self.np = None  # type: ignore[assignment]
        self.ctl.release()
        self.data.release()


class RingWriter(_Ring):
    """The writing end."""

    def free_slots(self) -> int:
        self._head = self.ctl[HEAD]
        return self.slot_count - (self._tail - self._head)

    def _await_space(self, needed: int) -> None:
        target = self._tail + needed - self.slot_count  # > head while we wait, so > 0
        self._await(WRITER_WAITING, target, lambda: self.free_slots() >= needed)

    def write(self, frames: Sequence[Frame]) -> None:
        n = len(frames)
        if not 0 < n <= self.max_frames:
            raise TransportError(
                "cannot send an empty message: a message needs at least one frame"
                if not n
                else f"a message of {n} frames exceeds the shm slot's {self.max_frames}: raise slot_size"
            )
        sizes = [f.nbytes if type(f) is memoryview else len(f) for f in frames]
        header = _message_header(n)
        total = header.size + sum(sizes)
        if total > self.slot_size:
            self._write_long(frames, sizes, header, total)
            return
        tail = self._tail
        if tail - self._head >= self.slot_count and self.free_slots() < 1:
            self._await_space(1)
        data = self.data
        off = (tail % self.slot_count) * self.slot_size
        header.pack_into(data, off, total, n, *sizes)
        p = off + header.size
        for frame, size in zip(frames, sizes):  # noqa: B905 (same length; a keyword costs 0.4 us here)
            if type(frame) is memoryview and (frame.ndim != 1 or frame.format != "B"):
                frame = _byte_view(frame)
            data[p : p + size] = frame
            p += size
        self._publish(tail + 1)

    def _write_long(
        self, frames: Sequence[Frame], sizes: list[int], header: struct.Struct, total: int
    ) -> None:
        sources = _Stream([np.frombuffer(header.pack(total, len(frames), *sizes), np.uint8)])
        sources.parts += [
            np.frombuffer(_byte_view(f), np.uint8) if s else _EMPTY
            for f, s in zip(frames, sizes, strict=True)
        ]
        ss, count = self.slot_size, self.slot_count
        step_slots = max(1, _STEP_BYTES // ss)
        pos = 0
        while pos < total:
            left = -(-(total - pos) // ss)  # slots still to write
            free = count - (self._tail - self._head)
            if free < 1:
                free = self.free_slots()
                if free < 1:
                    self._await_space(min(left, max(1, count // 4)))
                    continue
            slot = self._tail % count
            nslots = min(free, count - slot, left, step_slots)
            nbytes = min(nslots * ss, total - pos)
            sources.copy(self.np[slot * ss : slot * ss + nbytes], into_region=True)
            pos += nbytes
            self._publish(self._tail + nslots)

    def _publish(self, tail: int) -> None:
        if not _TSO:
            self.fence()  # release: the payload before the counter
        self.ctl[TAIL] = self._tail = tail
        self.fence()  # the counter before reading the reader's word (store -> load)
        waiting = self.ctl[READER_WAITING]
        if waiting and tail >= waiting:
            signal(self._wake_fd)


class RingReader(_Ring):
    """The reading end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool = BufferPool()

    def available(self) -> int:
        self._tail = self.ctl[TAIL]
        if not _TSO:
            self.fence()  # acquire: the counter before the payload
        return self._tail - self._head

    def ready(self) -> bool:
        """A message (or its start) is waiting."""
        return self._tail != self._head or self.available() > 0

    def arm(self) -> None:
        """Ask to be woken by the next message (the channel then re-checks and sleeps)."""
        self.ctl[READER_WAITING] = self._head + 1

    def disarm(self) -> None:
        self.ctl[READER_WAITING] = 0

    def read(self) -> list[Frame] | None:
        head = self._head
        if self._tail == head and self.available() < 1:
            return None
        data = self.data
        off = (head % self.slot_count) * self.slot_size
        total, n = _HEADER.unpack_from(data, off)
        if not 0 < n <= self.max_frames:
            raise TransportError(f"shm ring is corrupt: a message header says {n} frames")
        sizes = _lengths(n).unpack_from(data, off + _HEADER.size)
        hlen = _HEADER.size + 8 * n
        if total != hlen + sum(sizes):
            raise TransportError(
                f"shm ring is corrupt: a header says {total} bytes, its frames {hlen + sum(sizes)}"
            )
        if total > self.slot_size:
            return self._read_long(sizes, hlen, total)
        frames: list[Frame] = []
        p = off + hlen
        for size in sizes:
            frames.append(data[p : p + size].tobytes())
            p += size
        self._release(head + 1)
        return frames

    def _read_long(self, sizes: tuple[int, ...], hlen: int, total: int) -> list[Frame]:
        pool = self._pool
        buffers = [pool.take(s) if s >= _BIG_FRAME else bytearray(s) for s in sizes]
        dests = _Stream(
            [b if isinstance(b, np.ndarray) else np.frombuffer(b, np.uint8) for b in buffers]
        )
        ss, count = self.slot_size, self.slot_count
        step_slots = max(1, _STEP_BYTES // ss)
        pos, skip = 0, hlen
        while pos < total:
            left = -(-(total - pos) // ss)  # slots still to read
            avail = self._tail - self._head
            if avail < 1:
                avail = self.available()
                if avail < 1:
                    # at most a quarter ring each way: a waiting writer then always has woken us
                    needed = min(left, step_slots, max(1, count // 4))
                    self._await(
                        READER_WAITING, self._head + needed, lambda n=needed: self.available() >= n
                    )
                    continue
            slot = self._head % count
            nslots = min(avail, count - slot, left, step_slots)
            nbytes = min(nslots * ss, total - pos)
            dests.copy(self.np[slot * ss + skip : slot * ss + nbytes], into_region=False)
            pos += nbytes
            skip = 0
            self._release(self._head + nslots)
        return [memoryview(b) if isinstance(b, np.ndarray) else bytes(b) for b in buffers]

    def _release(self, head: int) -> None:
        self.ctl[HEAD] = self._head = head
        self.fence()  # the counter before reading the writer's word (store -> load)
        waiting = self.ctl[WRITER_WAITING]
        if waiting and head >= waiting:
            signal(self._wake_fd)
