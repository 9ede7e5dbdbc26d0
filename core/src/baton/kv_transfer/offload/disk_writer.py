"""Writes blocks to the disk tier behind the step: a queue and one background thread."""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from baton.kv_transfer.offload.disk_tier import BlockFileStore
from baton.kv_transfer.offload.worker_stats import WorkerStats

log = logging.getLogger(__name__)


class DiskWriter:
    """Stores ``(block_hash, tensor)`` in ``store``: in a background thread (``behind``) or at
    once. Behind, at most ``max_pending_bytes`` wait; past that a block is not written (a disk
    miss later, never wrong data), with one warning."""

    def __init__(
        self, store: BlockFileStore, stats: WorkerStats, *, behind: bool, max_pending_bytes: int
    ) -> None:
        self.store = store
        self.stats = stats
        self.behind = behind
        self.max_pending_bytes = max_pending_bytes
        self.dropped = 0
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if behind:
            self._thread = threading.Thread(
                target=self._run, name="baton-kv-disk-writer", daemon=True
            )
            self._thread.start()

    def submit(self, block_hash: bytes, tensor: torch.Tensor) -> None:
        """Store the block (``tensor`` must not change afterwards: a copy the caller owns)."""
        if self.store.full:
            return
        if not self.behind:
            self._write(block_hash, tensor)
            return
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning(
                        "the disk tier at %s writes slower than blocks arrive: more than %d bytes "
                        "wait, so some blocks are not written to disk",
                        self.store.root,
                        self.max_pending_bytes,
                    )
                return
            self._pending_bytes += nbytes
        self._queue.put((block_hash, tensor))

    def _write(self, block_hash: bytes, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            stored = self.store.put(block_hash, tensor)
        except OSError as exc:  # not a full disk (that stops storing): this block is skipped
            log.error("writing KV block %s to %s failed: %s", block_hash.hex(), self.store.dir, exc)
            return
        if stored:
            self.stats.add_save(tensor.numel() * tensor.element_size(), time.perf_counter() - start)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
                with self._lock:
                    self._pending_bytes -= item[1].numel() * item[1].element_size()
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every submitted block is written."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is pending, then stop the thread; idempotent."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None
