"""Built-in router ``prefix-aware``: requests that share a prompt prefix go to one engine.

Each engine keeps a prefix cache of its own, so a prefix computed on one engine
saves nothing on another. The router hashes a request's first
``prefix_blocks`` full KV blocks (each hash chained to the one before, salted
with ``cache_salt``, as the engines' prefix cache does) and sends the request to
the engine that last took the longest of those prefixes, unless that engine has
``balance_abs_threshold`` more requests in flight than the least loaded one:
then the least loaded engine takes it (and the prefix), so one hot prefix
cannot pile every request onto one engine. A prefix no engine has taken goes to
the engine holding the fewest prefix blocks among those within that load cap
(as SGLang's cache-aware router balances its trees): tenants' prefixes split
evenly over the engines' caches instead of following momentary load, which
would leave one engine more prefixes than its cache holds. Requests with no
full block go to the least loaded engine.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from baton.plugins.hookspecs import hookimpl
from baton.routing.routers import least_loaded
from baton.routing.types import EngineLoad, RouteRequest


class PrefixAwareSettings(BaseModel):
    """``[routing.prefix-aware]``."""

    model_config = ConfigDict(extra="forbid")

    prefix_blocks: int = Field(8, ge=1, le=1024)
    """Leading KV blocks of a prompt whose hashes decide the engine (longest match wins)."""
    balance_abs_threshold: int = Field(4, ge=0)
    """Most requests in flight the prefix's engine may have beyond the least loaded engine's
    and still take the request."""
    max_prefixes: int = Field(100_000, ge=1)
    """Prefix hashes remembered (least recently used forgotten first)."""


def prefix_hashes(request: RouteRequest, max_blocks: int) -> list[bytes]:
    """Chained hashes of the prompt's first full blocks: hash i covers blocks 0..i."""
    bs = request.block_size
    n = min(max_blocks, len(request.prompt_token_ids) // bs)
    seed = (request.cache_salt or "").encode()
    if request.lora_int_id:  # the engines' prefix cache keeps adapters apart too
        seed += b"\x00lora:%d" % request.lora_int_id
    h = hashlib.blake2b(seed, digest_size=16).digest()
    out = []
    for i in range(n):
        block = request.prompt_token_ids[i * bs : (i + 1) * bs]
        h = hashlib.blake2b(
            h + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16
        ).digest()
        out.append(h)
    return out


class PrefixAwareRouter:
    """Affinity of prompt prefixes to engines, with a load cap (module docstring)."""

    def __init__(self, settings: PrefixAwareSettings | None = None) -> None:
        self.settings = settings or PrefixAwareSettings()
        self._owner: OrderedDict[bytes, int] = OrderedDict()
        #: prefix block hashes each engine owns in ``_owner``
        self._owned: Counter[int] = Counter()

    def route(self, request: RouteRequest, engines: Sequence[EngineLoad]) -> int:
        hashes = prefix_hashes(request, self.settings.prefix_blocks)
        by_index = {e.engine_index: e for e in engines}
        cap = min(e.num_in_flight for e in engines) + self.settings.balance_abs_threshold
        chosen = None
        known = False
        for h in reversed(hashes):
            idx = self._owner.get(h)
            if idx is None or idx not in by_index:
                continue
            known = True
            if by_index[idx].num_in_flight <= cap:
                chosen = idx
            break  # the longest known prefix decides: its engine, or (overloaded) the least loaded
        if chosen is None and hashes and not known:
            # a new prefix: the engine with the fewest prefix blocks (the least loaded is in cap)
            chosen = min(
                (e for e in engines if e.num_in_flight <= cap),
                key=lambda e: (self._owned[e.engine_index], e.num_in_flight, e.engine_index),
            ).engine_index
        if chosen is None:
            chosen = least_loaded(engines)
        for h in hashes:
            old = self._owner.get(h)
            if old != chosen:
                if old is not None:
                    self._owned[old] -= 1
                self._owned[chosen] += 1
                self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self.settings.max_prefixes:
            _, idx = self._owner.popitem(last=False)
            self._owned[idx] -= 1
        return chosen

    def finished(self, request_id: str, engine_index: int) -> None:
        pass  # the engine keeps the prefix's blocks cached after the request ends


def _factory(config: Any, settings: PrefixAwareSettings | None) -> PrefixAwareRouter:
    return PrefixAwareRouter(settings)


@hookimpl
def register_routers(register) -> None:  # type: ignore[no-untyped-def]
    register("prefix-aware", _factory, PrefixAwareSettings)
