"""One engine's shared-memory segment and its wake FIFOs, under /dev/shm.

Files (all named ``baton_<frontend pid>_<token>_e<index>``, the FIFOs with a
suffix): the segment, and four FIFOs, one per (direction, reason to wake):

    in_data    the engine sleeps on it: its input ring has a message
    in_space   the frontend sleeps on it: the input ring has room again
    out_data   the frontend sleeps on it: the output ring has a message
    out_space  the engine sleeps on it: its output ring has room again

Named FIFOs rather than eventfds, because the engine is started with the
"spawn" method and a file path is all it can be handed. Both ends open every
FIFO read-write and non-blocking (Linux allows it): no open ever blocks and no
read sees end-of-file.

Cleanup: the frontend creates the files; the engine unlinks all of them as soon
as it has mapped and opened them, so from then on a crash of either side leaves
nothing behind (the memory lives while a mapping does). Files of an engine that
never attached are unlinked by the frontend's close(), its finalizer or atexit.
We map files ourselves instead of using multiprocessing.shared_memory, so
Python's resource_tracker never sees (nor warns about, nor unlinks) them.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from baton.errors import TransportError
from baton_shm.ring import CONTROL_BYTES

SHM_DIR = "/dev/shm"
PREFIX = "baton_"
MAGIC = int.from_bytes(b"batonshm", "little")
VERSION = 1
FIFOS = ("in_data", "in_space", "out_data", "out_space")

# int64 indices into the segment header
_MAGIC, _VERSION, _SLOT_SIZE, _SLOT_COUNT, _ENGINE_INDEX = 0, 1, 2, 3, 4
FRONTEND_PID, ENGINE_PID, FRONTEND_CLOSED, ENGINE_CLOSED = 5, 6, 7, 8
_HEADER_BYTES = 4096
_CONTROL_STRIDE = 2048  # ring i's control block sits at _HEADER_BYTES + i * stride
_DATA_START = _HEADER_BYTES + 2 * _CONTROL_STRIDE
INPUT, OUTPUT = 0, 1  # ring numbers: frontend -> engine, engine -> frontend


def segment_name(frontend_pid: int, token: str, engine_index: int) -> str:
    return f"{PREFIX}{frontend_pid}_{token}_e{engine_index}"


class Segment:
    """A mapped segment: ``header`` (int64 view), ring views, and the FIFO fds by name."""

    def __init__(self, name: str, mm: mmap.mmap, fifo_fds: dict[str, int]) -> None:
        self.name = name
        self._mm = mm
        self.buf = memoryview(mm)
        self.header = self.buf[:_HEADER_BYTES].cast("q")
        self.slot_size = self.header[_SLOT_SIZE]
        self.slot_count = self.header[_SLOT_COUNT]
        self.fifos = fifo_fds

    # ------------------------------------------------------------------ make / open

    @classmethod
    def create(cls, name: str, engine_index: int, slot_size: int, slot_count: int) -> Segment:
        """Create the files and map them (frontend side)."""
        if not os.path.isdir(SHM_DIR):
            raise TransportError(
                f"the shm transport needs {SHM_DIR} (Linux); use transport zmq here"
            )
        path = os.path.join(SHM_DIR, name)
        size = _DATA_START + 2 * slot_size * slot_count
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:  # reserve the pages now: a full /dev/shm must fail here, not SIGBUS later
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise TransportError(
                    f"cannot reserve {size} bytes in {SHM_DIR} for {name} ({e.strerror}): free space there, "
                    "or lower [transport.shm] slot_size / slot_count"
                ) from e
            mm = _map(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        fifo_fds: dict[str, int] = {}
        try:
            for fifo in FIFOS:
                os.mkfifo(f"{path}.{fifo}", 0o600)
                fifo_fds[fifo] = os.open(f"{path}.{fifo}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            for fd in fifo_fds.values():
                os.close(fd)
            mm.close()
            unlink_files(name)
            raise TransportError(f"cannot create the wake FIFOs of {name} in {SHM_DIR}: {e}") from e
        header = memoryview(mm)[:_HEADER_BYTES].cast("q")
        header[_MAGIC], header[_VERSION] = MAGIC, VERSION
        header[_SLOT_SIZE], header[_SLOT_COUNT] = slot_size, slot_count
        header[_ENGINE_INDEX], header[FRONTEND_PID] = engine_index, os.getpid()
        header.release()
        return cls(name, mm, fifo_fds)

    @classmethod
    def attach(cls, name: str, engine_index: int) -> Segment:
        """Map an existing segment, claim it, and unlink its files (engine side)."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TransportError(
                f"shm segment {path} does not exist: the frontend closed (or died) before engine "
                f"{engine_index} attached, or another engine took this index"
            ) from None
        try:
            mm = _map(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        fifo_fds: dict[str, int] = {}
        try:
            for fifo in FIFOS:
                fifo_fds[fifo] = os.open(f"{path}.{fifo}", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            for fd in fifo_fds.values():
                os.close(fd)
            mm.close()
            raise TransportError(f"cannot open the wake FIFOs of {path}: {e}") from e
        seg = cls(name, mm, fifo_fds)
        h = seg.header
        problem = None
        if h[_MAGIC] != MAGIC or h[_VERSION] != VERSION:
            problem = f"is not a baton shm segment of version {VERSION}"
        elif h[_ENGINE_INDEX] != engine_index:
            problem = f"belongs to engine {h[_ENGINE_INDEX]}, not {engine_index}"
        elif h[ENGINE_PID] != 0:
            problem = f"is already attached by pid {h[ENGINE_PID]}"
        if problem:
            seg.close()
            raise TransportError(f"shm segment {path} {problem}")
        h[ENGINE_PID] = os.getpid()
        unlink_files(name)  # both ends hold everything open now: nothing may outlive a crash
        return seg

    # ------------------------------------------------------------------ views / life

    def ring_views(self, ring: int) -> tuple[memoryview, memoryview]:
        """(control block, data area) of ring INPUT or OUTPUT."""
        ctl = _HEADER_BYTES + ring * _CONTROL_STRIDE
        cap = self.slot_size * self.slot_count
        data = _DATA_START + ring * cap
        return self.buf[ctl : ctl + CONTROL_BYTES], self.buf[data : data + cap]

    def close(self) -> None:
        """Close the FIFOs and unmap; every ring view must have been released first."""
        for fd in self.fifos.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fifos = {}
        self.header.release()
        self.buf.release()
        with contextlib.suppress(
            BufferError
        ):  # a view still alive somewhere: unmapped when it goes
            self._mm.close()


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE: fault every page in now, not one by one in the first messages
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


def unlink_files(name: str) -> None:
    """Remove a segment's files; missing ones are fine (the other side got there first)."""
    path = os.path.join(SHM_DIR, name)
    for p in (path, *(f"{path}.{fifo}" for fifo in FIFOS)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def leftover_files(pid: int | None = None) -> list[str]:
    """baton shm files in /dev/shm (of frontend ``pid`` if given): for leak checks."""
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}_"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []
