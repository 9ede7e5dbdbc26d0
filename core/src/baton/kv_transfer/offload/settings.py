"""``[kv_transfer.offload]``: the sizes and place of the offload connector's tiers."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ByteSize, ConfigDict, Field


class OffloadSettings(BaseModel):
    """``[kv_transfer.offload]``."""

    model_config = ConfigDict(extra="forbid")

    cpu_memory: ByteSize = Field(ByteSize(1 << 30), ge=0)
    """Bytes of host RAM for KV blocks the engine's pool evicted or will evict, e.g. "2GiB"
    (least recently used blocks go first). All of an engine's workers together: each holds its
    share of every block (its layers and heads). 0: no RAM tier."""
    disk_path: Path | None = None
    """A directory for the disk tier (created if missing); None: no disk tier. Several engines
    may share it (atomic writes; each block checked when read); it outlives a restart."""
    disk_memory: ByteSize = Field(ByteSize(8 << 30), gt=0)
    """Byte budget of the disk tier's directory, e.g. "20GiB": past it, the least recently used
    block files (of any engine sharing the directory) are deleted."""
    disk_write_behind: bool = True
    """Write block files in a background thread, so a step never waits for the disk (a block
    not yet written is a disk miss). False: each step writes its blocks before returning."""
