"""``[kv_transfer.pd]``: where the hand-off store lives and how long a consumer waits for it."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ByteSize, ConfigDict, Field


class PDSettings(BaseModel):
    """``[kv_transfer.pd]`` settings (the same on the producer and its consumers)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: Path = Path("/dev/shm/baton-pd")
    """The folder the engines share (RAM-backed: /dev/shm); one subfolder per model namespace
    and worker shard, one checked file per block."""
    memory: ByteSize = Field(ByteSize(1 << 30), gt=0)
    """Byte budget of the folder, e.g. "4GiB": past it the least recently used blocks (of any
    engine sharing it) are deleted. A consumer that finds a block gone recomputes it."""
    load_timeout: float = Field(3.0, gt=0.0, le=600.0)
    """Seconds a consumer waits for a block the producer has not written yet; then the rest
    of the prompt is recomputed (a dead producer costs this, never a hang)."""
    engine_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """This engine's id in the hand-offs it produces (default: host name, process id and
    data-parallel rank)."""
