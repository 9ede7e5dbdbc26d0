"""``[kv_transfer.pd]``: where the hand-off store lives and how long a consumer waits for it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PDSettings(BaseModel):
    """``[kv_transfer.pd]`` settings (the same on the producer and the consumer)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str = "/dev/shm/baton-pd"
    """The folder both engines share (a RAM-backed one: /dev/shm); one subfolder per model
    namespace, one per hand-off under it."""
    load_timeout: float = Field(3.0, gt=0.0, le=600.0)
    """Seconds a consumer waits for a block the producer has not written yet; then the rest
    of the prompt is recomputed (a dead producer costs this, never a hang)."""
    max_age: float = Field(300.0, gt=0.0)
    """Seconds a hand-off no consumer took stays in the store before a producer removes it."""
    engine_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """This engine's id in the hand-offs it produces (default: host name, process id and
    data-parallel rank)."""
