"""Plugin module of baton-plugin-zmq: registers transport ``zmq``.

Settings come from the ``[transport.zmq]`` sub-table (or
``BATON_TRANSPORT__ZMQ__<FIELD>``), validated by ``ZmqSettings``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton import hookimpl

BATON_PLUGIN_API = 1


class ZmqSettings(BaseModel):
    """``[transport.zmq]``: how the ZeroMQ sockets are made."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: Literal["ipc", "tcp"] = "ipc"
    """ipc: unix sockets under a fresh private temp dir; tcp: 127.0.0.1 on free ports."""
    host: str = "127.0.0.1"
    """Interface for protocol = "tcp": an address of this machine the engines connect to (for
    engines on other hosts, e.g. executor.data_parallel_backend = "ray" over several nodes, one
    they can reach, not the loopback)."""
    hwm: int = Field(0, ge=0)
    """High-water mark (messages queued per peer); 0 = unbounded, so send never blocks."""
    send_timeout: float = Field(30.0, gt=0)
    """Seconds a send may wait when ``hwm`` is reached before it raises TransportError."""
    connect_timeout: float = Field(60.0, gt=0)
    """Seconds a client send waits for an engine that has not connected yet."""
    linger: float = Field(0.5, ge=0)
    """Seconds close() keeps trying to deliver queued messages (e.g. a final ENGINE_CORE_DEAD)."""
    socket_buffer: int = Field(1 << 20, ge=0)
    """Kernel send/receive buffer per socket, bytes (the OS caps it at net.core.wmem_max / rmem_max);
    larger means fewer hand-offs for big tensors. 0 keeps the OS default."""
    copy_threshold: int = Field(65536, ge=0)
    """Frames at least this large are sent and received without a copy; smaller ones are copied (faster)."""


def create_transport(config: Any = None, settings: ZmqSettings | None = None) -> Any:
    """The registered factory: ``factory(config, settings)``."""
    from baton_zmq.transport import ZmqTransport  # pyzmq loads only when zmq is chosen

    return ZmqTransport(settings or ZmqSettings())


@hookimpl
def register_transports(register: Any) -> None:
    register("zmq", create_transport, settings_model=ZmqSettings)
