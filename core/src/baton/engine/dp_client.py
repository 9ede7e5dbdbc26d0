"""Data parallel: one asyncio client, several engine cores, a router picking each request's.

Every engine core runs the whole model with its own scheduler and KV cache; the
client sends each new request to the engine the configured router
(``routing.router``, a plugin kind: ``baton.interfaces.Router``) picks from the
engines' loads, and sends aborts and utility calls where they belong. The loads
are the client's own count of requests in flight per engine and each engine's
latest scheduler stats; all of it is touched on the client's event loop only
(the output thread hands stats and finished requests over to it).
"""

from __future__ import annotations

import asyncio

from baton.config import BatonConfig
from baton.engine.mp_client import AsyncMPClient
from baton.errors import EngineDeadError, PluginError
from baton.interfaces import Router, Transport
from baton.plugins import get_registry
from baton.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from baton.routing.types import EngineLoad, RouteRequest


class DPAsyncMPClient(AsyncMPClient):
    """Several engines behind one asyncio client; ``routing.router`` places each request."""

    def __init__(
        self,
        config: BatonConfig,
        transport: Transport,
        num_engines: int,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        entry = get_registry().get("router", config.routing.router)
        self.router: Router = entry.create(config, entry.settings(config))
        self._router_name = config.routing.router
        self._owner: dict[str, int] = {}
        self._in_flight = [0] * num_engines
        self._stats: list[SchedulerStats | None] = [None] * num_engines
        #: prompt tokens looked up in each engine's prefix cache so far, and found cached
        self._prefix_queries = [0] * num_engines
        self._prefix_hits = [0] * num_engines
        super().__init__(config, transport, num_engines, loop)

    def engine_loads(self) -> list[EngineLoad]:
        """Every engine's load as the router sees it now."""
        loads = []
        for i in range(self.num_engines):
            st = self._stats[i]
            loads.append(
                EngineLoad(
                    engine_index=i,
                    num_in_flight=self._in_flight[i],
                    num_running=st.num_running_reqs if st else 0,
                    num_waiting=st.num_waiting_reqs if st else 0,
                    kv_cache_usage=st.kv_cache_usage if st else 0.0,
                    prefix_cache_queries=self._prefix_queries[i],
                    prefix_cache_hits=self._prefix_hits[i],
                )
            )
        return loads

    def engine_for(self, request_id: str) -> int:
        return self._owner.get(request_id, 0)

    def add_request(self, request: EngineCoreRequest) -> None:
        route = RouteRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            cache_salt=request.cache_salt,
            user=request.user,
            priority=request.priority,
            block_size=self.config.cache.block_size,
        )
        idx = self.router.route(route, self.engine_loads())
        if type(idx) is not int or not 0 <= idx < self.num_engines:
            raise PluginError(
                f"router {self._router_name!r} returned engine {idx!r} for request "
                f"{request.request_id!r}: it must return the engine_index of one of the "
                f"{self.num_engines} engines (0..{self.num_engines - 1})"
            )
        self._owner[request.request_id] = idx
        self._in_flight[idx] += 1
        try:
            super().add_request(request)
        except BaseException:
            self._release(request.request_id)
            raise

    def _release(self, request_id: str) -> None:
        idx = self._owner.pop(request_id, None)
        if idx is not None:
            self._in_flight[idx] -= 1
            self.router.finished(request_id, idx)

    def _note(self, item: EngineCoreOutputs) -> None:
        """On the loop: an engine's outputs finished requests and brought its stats."""
        for out in item.outputs:
            if out.finish_reason is not None:
                self._release(out.request_id)
        for rid in item.finished_requests or ():
            self._release(rid)
        st = item.scheduler_stats
        if st is not None and 0 <= item.engine_index < self.num_engines:
            self._stats[item.engine_index] = st
            self._prefix_queries[item.engine_index] += st.prefix_cache_queries
            self._prefix_hits[item.engine_index] += st.prefix_cache_hits

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        if isinstance(item, EngineCoreOutputs):
            try:
                self._loop.call_soon_threadsafe(self._note, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return
        super()._deliver(item)

    def abort_requests(self, request_ids: list[str]) -> None:
        super().abort_requests(request_ids)
        for rid in request_ids:
            self._release(rid)


__all__ = ["DPAsyncMPClient"]
