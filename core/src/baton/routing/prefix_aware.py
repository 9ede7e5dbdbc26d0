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

With ``use_kv_events`` the router also reads the engines' KV events (``[kv_events]``,
``baton.routing.kv_event_index``): the engine within the load cap whose pool holds the most of
the prompt's leading blocks (the engines' own block hashes) takes the request, whoever placed
them there and whatever was evicted since; a prompt no pool holds is placed as above.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from baton.errors import ConfigError
from baton.kv.event_publisher import rank_endpoint
from baton.kv.events import ExternalBlockHash, int_block_hash
from baton.kv.hashing import hash_block, root_hash
from baton.plugins.hookspecs import hookimpl
from baton.routing.routers import least_loaded
from baton.routing.types import EngineLoad, RouteRequest

if TYPE_CHECKING:
    from baton.config import BatonConfig, KVEventsSection
    from baton.routing.kv_event_index import KVEventIndex


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
    use_kv_events: bool = False
    """Also follow the engines' KV events (needs kv_events.enable_kv_cache_events with
    publisher "zmq"): a request goes to the engine within the load cap whose pool holds the most
    of its leading blocks, as the engines' BlockStored / BlockRemoved say (docs/kv-events.md)."""


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


def engine_block_hashes(
    request: RouteRequest, max_blocks: int, as_int: bool = True
) -> list[ExternalBlockHash]:
    """The engines' own hashes of the prompt's first full blocks (``baton.kv.hashing``), as
    their KV events carry them (the low 64 bits as ints, or the digests). An adapter's part is
    its id: an id registered again for another folder hashes differently in the engine (a miss)."""
    bs = request.block_size
    n = min(max_blocks, len(request.prompt_token_ids) // bs)
    lora_key = str(request.lora_int_id) if request.lora_int_id else None
    parent = root_hash(request.cache_salt, lora_key)
    out: list[ExternalBlockHash] = []
    for i in range(n):
        parent = hash_block(parent, request.prompt_token_ids[i * bs : (i + 1) * bs])
        out.append(int_block_hash(parent) if as_int else parent)
    return out


class PrefixAwareRouter:
    """Affinity of prompt prefixes to engines, with a load cap (module docstring).

    ``index``: what the engines' KV events say their pools hold (``use_kv_events``), hashes as
    ints when ``int_hashes`` (``kv_events.int_block_hashes``); None: the router's own books only.
    """

    def __init__(
        self,
        settings: PrefixAwareSettings | None = None,
        index: KVEventIndex | None = None,
        int_hashes: bool = True,
    ) -> None:
        self.settings = settings or PrefixAwareSettings()
        self.index = index
        self._int_hashes = int_hashes
        self._owner: OrderedDict[bytes, int] = OrderedDict()
        #: prefix block hashes each engine owns in ``_owner``
        self._owned: Counter[int] = Counter()

    def route(self, request: RouteRequest, engines: Sequence[EngineLoad]) -> int:
        hashes = prefix_hashes(request, self.settings.prefix_blocks)
        by_index = {e.engine_index: e for e in engines}
        cap = min(e.num_in_flight for e in engines) + self.settings.balance_abs_threshold
        chosen = None if self.index is None else self._pool_holder(request, engines, cap)
        known = chosen is not None
        for h in reversed(hashes) if chosen is None else ():
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

    def _pool_holder(
        self, request: RouteRequest, engines: Sequence[EngineLoad], cap: int
    ) -> int | None:
        """The engine within ``cap`` whose pool holds the most leading blocks (ties: the less
        loaded); None when no such pool holds the first."""
        assert self.index is not None
        hashes = engine_block_hashes(request, self.settings.prefix_blocks, self._int_hashes)
        if not hashes:
            return None
        matched = self.index.matched_blocks(hashes)
        best = max(
            (e for e in engines if e.num_in_flight <= cap and matched[e.engine_index]),
            key=lambda e: (matched[e.engine_index], -e.num_in_flight, -e.engine_index),
            default=None,
        )
        return None if best is None else best.engine_index

    def finished(self, request_id: str, engine_index: int) -> None:
        pass  # the engine keeps the prefix's blocks cached after the request ends

    def close(self) -> None:
        """Stop following the engines' KV events (the client shuts down)."""
        if self.index is not None:
            self.index.close()


def _event_index(ev: KVEventsSection, n: int) -> KVEventIndex:
    """The engines' KV events, followed from the frontend: one endpoint per engine core
    (``n``: data_parallel_size)."""
    if not ev.enable_kv_cache_events or ev.publisher != "zmq":
        raise ConfigError(
            "routing.prefix-aware.use_kv_events follows the engines' KV events: set "
            "kv_events.enable_kv_cache_events = true with kv_events.publisher = 'zmq' (got "
            f"enable_kv_cache_events = {ev.enable_kv_cache_events}, publisher = {ev.publisher!r})"
        )
    try:
        # pyzmq is optional (baton-core[kv-events]): imported only when the router follows events
        from baton.routing.kv_event_index import KVEventIndex
    except ImportError as e:
        if e.name != "zmq":
            raise
        raise ConfigError(
            "routing.prefix-aware.use_kv_events needs pyzmq, which is not installed: pip "
            "install 'baton-core[kv-events]' (or pyzmq)"
        ) from e
    return KVEventIndex(
        [rank_endpoint(ev.endpoint, r) for r in range(n)],
        [
            None if ev.replay_endpoint is None else rank_endpoint(ev.replay_endpoint, r)
            for r in range(n)
        ],
        ev.topic,
    )


def _factory(config: BatonConfig, settings: PrefixAwareSettings | None) -> PrefixAwareRouter:
    settings = settings or PrefixAwareSettings()
    index = (
        _event_index(config.kv_events, config.executor.data_parallel_size)
        if settings.use_kv_events
        else None
    )
    return PrefixAwareRouter(settings, index, config.kv_events.int_block_hashes)


@hookimpl
def register_routers(register) -> None:  # type: ignore[no-untyped-def]
    register("prefix-aware", _factory, PrefixAwareSettings)
