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
import contextlib
import logging
import time
from concurrent.futures import Future
from typing import Any

from baton.config import BatonConfig
from baton.engine.mp_client import AsyncMPClient
from baton.errors import EngineDeadError, PluginError
from baton.interfaces import Router, Transport
from baton.parallel.expert import expert_parallel_size
from baton.plugins.resolve import ResolvedPlugins
from baton.protocol import (
    DPWaveStart,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    SchedulerStats,
)
from baton.routing.types import EngineLoad, RouteRequest

log = logging.getLogger(__name__)


class DPAsyncMPClient(AsyncMPClient):
    """Several engines behind one asyncio client; ``routing.router`` places each request."""

    def __init__(
        self,
        config: BatonConfig,
        plugins: ResolvedPlugins,
        transport: Transport,
        num_engines: int,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.router: Router = plugins.one("router").create(config)
        self._router_name = config.routing.router
        self._owner: dict[str, int] = {}
        self._in_flight = [0] * num_engines
        self._stats: list[SchedulerStats | None] = [None] * num_engines
        #: prompt tokens looked up in each engine's prefix cache so far, and found cached
        self._prefix_queries = [0] * num_engines
        self._prefix_hits = [0] * num_engines
        #: With expert parallel the engines step in waves (engine/dp_core_proc.py): the store
        #: they meet at, and what this client knows of the waves; None: independent engines.
        self._store: Any = None
        self.waves: Waves | None = None
        try:
            if expert_parallel_size(config.executor, config.model) > 1:
                self._store = _serve_store(config.executor.data_parallel_master_port)
                self.waves = Waves()
            super().__init__(config, plugins, transport, num_engines=num_engines, loop=loop)
        except BaseException:
            self._close_router()
            raise

    def _engine_config(self, index: int) -> BatonConfig:
        update: dict[str, Any] = {"data_parallel_rank": index}
        if self._store is not None:
            update["data_parallel_master_port"] = self._store.port
        executor = self.config.executor.model_copy(update=update)
        return self.config.model_copy(update={"executor": executor})

    def engine_loads(self) -> list[EngineLoad]:
        """The load of every engine still alive, as the router sees it now."""
        loads = []
        for i in self.live_engines():
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

    def live_engines(self) -> list[int]:
        return [i for i in range(self.num_engines) if i not in self._gone]

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
            lora_int_id=request.lora_request.lora_int_id if request.lora_request else 0,
        )
        self._check_alive()
        engines = self.engine_loads()
        idx = self.router.route(route, engines)
        if type(idx) is not int or idx not in {e.engine_index for e in engines}:
            raise PluginError(
                f"router {self._router_name!r} returned engine {idx!r} for request "
                f"{request.request_id!r}: it must return the engine_index of one of the "
                f"engines it was given ({', '.join(str(e.engine_index) for e in engines)})"
            )
        self._owner[request.request_id] = idx
        self._in_flight[idx] += 1
        try:
            if self.waves is not None and not self.waves.running:
                # the engines are idle: start the next wave on the others, this one joins it
                # with the request
                self._start_wave(self.waves.start(), exclude=idx)
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
        if self.waves is not None:
            if item.wave_complete is not None:
                self.waves.completed(item.wave_complete)
            if item.start_wave is not None and self.waves.started_by_engine(item.start_wave):
                self._start_wave(item.start_wave, exclude=item.engine_index)
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
            if not item.outputs and item.scheduler_stats is None:
                return  # a wave message: for this client only
        super()._deliver(item)

    def shutdown(self) -> None:
        super().shutdown()
        self._store = None  # the engines are gone: stop serving their store
        self._close_router()

    def _close_router(self) -> None:
        """The router's optional ``close()`` (a router that follows the engines, say)."""
        close = getattr(self.router, "close", None)
        if callable(close):
            close()

    def _start_wave(self, wave: int, exclude: int) -> None:
        """START_DP_WAVE to every live engine but ``exclude`` (which started it itself)."""
        start = DPWaveStart(wave=wave, exclude_engine=exclude)
        for i in self.live_engines():
            if i != exclude:
                self._send(RequestType.START_DP_WAVE, start, i)

    def abort_requests(self, request_ids: list[str]) -> None:
        # requests of a dead engine, or finished ones, have no engine to tell
        live = [r for r in request_ids if self._owner.get(r, -1) not in self._gone | {-1}]
        super().abort_requests(live)
        for rid in request_ids:
            self._release(rid)

    def _utility_future(
        self, method: str, args: tuple[Any, ...], engine_index: int = 0
    ) -> Future[Any]:
        live = self.live_engines()
        if engine_index in self._gone and live:
            engine_index = live[0]  # the first engine alive answers for the client
        return super()._utility_future(method, args, engine_index)

    # ------------------------------------------------------------------ one engine's death

    def _engine_died(self, index: int | None, message: str) -> bool:
        policy = self.config.routing.on_engine_death
        if self.waves is not None:  # the others' MoE layers wait for it: the group is dead
            return super()._engine_died(
                index, f"{message} (its experts are gone: expert-parallel engines fail together)"
            )
        if policy == "fail-server" or index is None or not 0 <= index < self.num_engines:
            return super()._engine_died(index, message)
        if not self.live_engines():
            return super()._engine_died(index, f"every engine died; the last: {message}")
        log.error(
            "engine %d died (%s): its requests fail; engines %s go on (routing.on_engine_death "
            "= fail-requests)",
            index,
            message,
            self.live_engines(),
        )
        # a RuntimeError means the loop is closed: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._fail_engine, index, message)
        return True

    def _transport_failed(self, error: BaseException) -> bool:
        forget = getattr(self.resources.channel, "forget_engine", None)
        fail_one = self.config.routing.on_engine_death == "fail-requests" and self.waves is None
        if not fail_one or forget is None:
            return super()._transport_failed(error)
        # the channel saw an engine exit: find which (a forkserver child's exit code can lag
        # its pidfd by a moment), handle its death, and have the channel forget it
        deadline = time.monotonic() + 2.0
        while True:
            dead = [i for i, p in enumerate(self.resources.procs) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not dead or not self._check_engines():
            return super()._transport_failed(error) if self.dead_error is None else False
        for i in dead:
            forget(i)
        return True

    def _fail_engine(self, index: int, message: str) -> None:
        """On the loop: every request engine ``index`` held ends with an error."""
        rids = [rid for rid, owner in self._owner.items() if owner == index]
        error = f"EngineDeadError: engine {index} died: {message}"
        outs = EngineCoreOutputs(
            engine_index=index,
            outputs=[
                EngineCoreOutput(
                    request_id=rid, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error
                )
                for rid in rids
            ],
        )
        self._note(outs)
        if rids:
            self._outputs_async.put_nowait(outs)


class Waves:
    """What the frontend knows of the engines' waves (touched on the client's loop only).

    ``current`` is the wave the engines are in (running) or start next (idle). An engine's
    ``wave_complete`` for the current wave makes them idle; a ``start_wave`` from an engine
    that got a request while idle starts its wave, unless that wave is running or over.
    """

    def __init__(self) -> None:
        self.current = 0
        self.running = False
        self.completed_waves = 0

    def start(self) -> int:
        """A request arrives while the engines are idle: the wave to start."""
        self.running = True
        return self.current

    def completed(self, wave: int) -> None:
        if wave >= self.current:  # else stale: a later wave has started since
            self.current = wave + 1
            self.running = False
            self.completed_waves += 1

    def started_by_engine(self, wave: int) -> bool:
        """An engine started ``wave``; True when the others must be told."""
        if wave > self.current or (wave == self.current and not self.running):
            self.current = wave
            self.running = True
            return True
        return False


def _serve_store(port: int) -> Any:
    """The TCPStore on 127.0.0.1 the engines build their process groups over (0: a free port)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)


__all__ = ["DPAsyncMPClient", "Waves"]
