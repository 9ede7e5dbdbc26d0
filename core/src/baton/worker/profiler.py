"""A worker's torch profiler: ``start_profile`` / ``stop_profile`` write a chrome trace (JSON).

The trace goes to ``observability.profile_dir`` (vLLM's ``VLLM_TORCH_PROFILER_DIR``), one file
per worker process per profile: ``baton-worker<rank>-pid<pid>-<time>-<n>.pt.trace.json``, which
chrome://tracing and Perfetto open.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from baton.errors import ConfigError, InvalidRequestError

log = logging.getLogger(__name__)


def profile_dir(configured: str | None) -> Path:
    """``observability.profile_dir`` as a folder (made if missing); ConfigError when unset."""
    if not configured:
        raise ConfigError(
            "observability.profile_dir is not set: set it (BATON_OBSERVABILITY__PROFILE_DIR, "
            "[observability] profile_dir) to a folder for the torch profiler's traces"
        )
    folder = Path(configured).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class WorkerProfiler:
    """One worker's profiler: CPU activities, and CUDA's on a GPU device."""

    def __init__(self, folder: Path, rank: int, device: torch.device | None) -> None:
        self.folder = folder
        self.rank = rank
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device is not None and device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile: Any = None
        self._written = 0  # traces so far: two in one second get distinct names

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self._profile is not None:
            raise InvalidRequestError(
                f"worker {self.rank} is already profiling: call stop_profile() first"
            )
        prof = torch.profiler.profile(activities=self.activities, record_shapes=True)
        prof.start()
        self._profile = prof
        log.info("worker %d: profiling (traces to %s)", self.rank, self.folder)

    def stop(self) -> str:
        """Stop and write the trace; its path."""
        prof, self._profile = self._profile, None
        if prof is None:
            raise InvalidRequestError(
                f"worker {self.rank} is not profiling: call start_profile() first"
            )
        prof.stop()
        self._written += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"baton-worker{self.rank}-pid{os.getpid()}-{stamp}-{self._written}.pt.trace.json"
        path = self.folder / name
        prof.export_chrome_trace(str(path))
        log.info("worker %d: profile written to %s", self.rank, path)
        return str(path)
