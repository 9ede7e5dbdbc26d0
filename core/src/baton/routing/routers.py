"""Built-in routers ``least-loaded`` and ``round-robin``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from baton.plugins.hookspecs import hookimpl
from baton.routing.types import EngineLoad, RouteRequest


def least_loaded(engines: Sequence[EngineLoad]) -> int:
    """The engine with the fewest requests in flight (the lowest index on a tie)."""
    return min(engines, key=lambda e: (e.num_in_flight, e.engine_index)).engine_index


class LeastLoadedRouter:
    """Each request to the engine with the fewest requests in flight."""

    def route(self, request: RouteRequest, engines: Sequence[EngineLoad]) -> int:
        return least_loaded(engines)

    def finished(self, request_id: str, engine_index: int) -> None:
        pass


class RoundRobinRouter:
    """Requests to the engines in turn, whatever their load."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def route(self, request: RouteRequest, engines: Sequence[EngineLoad]) -> int:
        return engines[next(self._next) % len(engines)].engine_index

    def finished(self, request_id: str, engine_index: int) -> None:
        pass


def _least_loaded(config: Any, settings: Any) -> LeastLoadedRouter:
    return LeastLoadedRouter()


def _round_robin(config: Any, settings: Any) -> RoundRobinRouter:
    return RoundRobinRouter()


@hookimpl
def register_routers(register) -> None:  # type: ignore[no-untyped-def]
    register("least-loaded", _least_loaded)
    register("round-robin", _round_robin)
