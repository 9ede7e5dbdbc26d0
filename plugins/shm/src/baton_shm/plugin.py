"""Plugin module of baton-plugin-shm: registers transport ``shm``.

Settings come from the ``[transport.shm]`` sub-table (or
``BATON_TRANSPORT__SHM__<FIELD>``), validated by ``ShmSettings``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from baton import hookimpl

BATON_PLUGIN_API = 1


class ShmSettings(BaseModel):
    """``[transport.shm]``: the geometry of each ring (two per engine) and how long to wait."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slot_size: int = Field(8192, ge=256, le=1 << 26, multiple_of=64)
    """Bytes per slot. A message starts at a slot; a longer one runs on through the next slots."""
    slot_count: int = Field(2048, ge=2)
    """Slots per ring. Each engine has two rings of slot_size * slot_count bytes (default 16 MiB each)."""
    spin_us: float = Field(50.0, ge=0, le=10_000)
    """Microseconds a reader keeps polling an empty ring before it sleeps: a stream's next message
    usually comes sooner than a sleep and a wake-up would take. 0: sleep at once."""
    send_timeout: float = Field(30.0, gt=0)
    """Seconds a send waits on a full ring (or a recv on a half-written message) before TransportError."""


def create_transport(config: Any = None, settings: ShmSettings | None = None) -> Any:
    """The registered factory: ``factory(config, settings)``."""
    from baton_shm.transport import ShmTransport

    return ShmTransport(settings or ShmSettings())


@hookimpl
def register_transports(register: Any) -> None:
    register("shm", create_transport, settings_model=ShmSettings)
