"""make_client: the engine client a config and the caller's mode get: the core in this process
(``InprocClient``), or behind a transport's channel (``baton.engine.mp_client``), one engine or
data-parallel ones (``baton.engine.dp_client``)."""

from __future__ import annotations

import asyncio
from typing import Any

from baton.config import BatonConfig
from baton.engine.client import EngineCoreClient, InprocClient
from baton.errors import InvalidRequestError
from baton.interfaces import Transport
from baton.plugins.resolve import ResolvedPlugins


def make_client(
    config: BatonConfig,
    plugins: ResolvedPlugins,
    *,
    asyncio_mode: bool = False,
    **core_kwargs: Any,
) -> EngineCoreClient:
    """The client face for this config's transport and the caller's mode (``plugins``: the
    config's, resolved once by the frontend)."""
    if not asyncio_mode and config.executor.data_parallel_size > 1:
        raise InvalidRequestError(
            f"executor.data_parallel_size = {config.executor.data_parallel_size} needs the "
            "asyncio frontend (AsyncLLM, baton serve): the synchronous LLM runs one engine; "
            "set it to 1 here"
        )
    transport = plugins.one("transport").create(config)
    if not transport.multiprocess and not asyncio_mode:
        return InprocClient(config, plugins=plugins, **core_kwargs)
    return make_mp_client(config, plugins, transport, asyncio_mode=asyncio_mode, **core_kwargs)


def make_mp_client(
    config: BatonConfig,
    plugins: ResolvedPlugins,
    transport: Transport,
    *,
    asyncio_mode: bool,
    loop: asyncio.AbstractEventLoop | None = None,
    **_: Any,
) -> EngineCoreClient:
    """A client for the core behind ``transport``'s channel: one engine, or data-parallel ones."""
    # torch (tensor frames, the engine process's entry): only when a multi-process client is made
    from baton.engine import dp_client, mp_client

    num_engines = config.executor.data_parallel_size
    if not asyncio_mode:  # make_client refused data_parallel_size > 1 here already
        return mp_client.SyncMPClient(config, plugins, transport)
    if num_engines > 1:
        return dp_client.DPAsyncMPClient(config, plugins, transport, num_engines, loop=loop)
    return mp_client.AsyncMPClient(config, plugins, transport, loop=loop)
