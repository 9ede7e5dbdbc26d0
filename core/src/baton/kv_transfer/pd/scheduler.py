"""The ``pd`` connector's scheduler half: which blocks a producer saves, which a consumer loads.

Producer (``do_remote_decode``): every full prompt block, once computed (prefix-cache hits
included), is copied into the store in the step that computes it; ``request_finished`` returns
the ``PDHandoff`` a consumer needs. Consumer (``do_remote_prefill``): the blocks after the
engine's own prefix hits, up to the last full block before the prompt's last token, load
asynchronously (the request waits, holding its blocks); a missing or bad block ends the load
there and the rest is recomputed.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from baton.errors import InvalidRequestError
from baton.kv_transfer.connector import KVBlockRef, KVSchedulerContext, KVStep
from baton.kv_transfer.pd.orders import ENCODER, PDLoad, PDOrders
from baton.kv_transfer.pd.params import (
    MEDIUM,
    PARAM,
    PDHandoff,
    parse_handoff,
    wants_load,
    wants_save,
)
from baton.kv_transfer.pd.settings import PDSettings
from baton.kv_transfer.types import KVConnectorOutput, KVTransferStats
from baton.request import Request, RequestStatus

#: A producer's request ended with its prompt computed: its hand-off is complete.
_HANDED_OFF = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def default_engine_id(engine_index: int) -> str:
    """Host name, process id and data-parallel rank, as a plain name."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-dp{engine_index}"


@dataclass
class _Produce:
    """A producer request: its block table and how many of its blocks are ordered saved."""

    request: Request
    block_ids: Sequence[int] = ()
    saved: int = 0


class PDScheduler:
    """The scheduler half of ``pd`` (module docstring)."""

    def __init__(self, context: KVSchedulerContext, settings: PDSettings) -> None:
        self.role = context.role
        self.namespace = context.namespace.key
        self.block_size = context.namespace.block_size
        self.settings = settings
        self.engine_id = settings.engine_id or default_engine_id(context.engine_index)
        self._producing: dict[str, _Produce] = {}
        self._consuming: dict[str, int] = {}  # asked: the index of the first block to load
        self._loading: set[str] = set()  # ordered, not yet reported
        self._loaded: set[str] = set()  # loaded once: never again (preempted and re-admitted)
        self._orders = PDOrders()
        self._stats = KVTransferStats()

    # -- admission ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Asked on a consumer (and ``both``) only: a producer's engine never loads."""
        params = request.kv_transfer_params
        if not wants_load(params):
            return 0, False
        handoff = parse_handoff(params, self.namespace, self.block_size)  # type: ignore[arg-type]
        rid = request.request_id
        if rid in self._loaded or rid in self._loading:
            return 0, False
        bs = self.block_size
        # never the prompt's last token: the consumer computes it to sample the first output
        usable = min(handoff.num_tokens, (request.num_prompt_tokens - 1) // bs * bs)
        n = usable - num_computed_tokens
        if n <= 0:
            self._consuming.pop(rid, None)
            return 0, False
        self._consuming[rid] = num_computed_tokens // bs
        return n, True

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Called for every admitted request, whatever the role: where the role's refusals are."""
        params = request.kv_transfer_params
        rid = request.request_id
        if wants_save(params):
            self._refuse_unless("producer", "do_remote_decode")
            self._producing.setdefault(rid, _Produce(request)).block_ids = list(block_ids)
        elif wants_load(params):
            self._refuse_unless("consumer", "do_remote_prefill")
        first = self._consuming.pop(rid, None)
        if first is None or num_external_tokens <= 0:
            return  # no room for the load: the request computes its prompt itself
        last = first + num_external_tokens // self.block_size
        blocks = [KVBlockRef(block_ids[i], request.block_hashes[i]) for i in range(first, last)]
        self._orders.loads.append(
            PDLoad(request_id=rid, blocks=blocks, timeout=self.settings.load_timeout)
        )
        self._loading.add(rid)

    def _refuse_unless(self, role: str, flag: str) -> None:
        if self.role not in (role, "both"):
            raise InvalidRequestError(
                f"{PARAM}.{flag} asks this engine for what a pd {role} does, but it is a pd "
                f"{self.role} ([kv_transfer] role = {self.role!r}): send the request to a "
                f"{role} engine",
                param=PARAM,
            )

    # -- steps ----------------------------------------------------------------------------

    def build_connector_meta(self, step: KVStep) -> bytes:
        bs = self.block_size
        for produce in self._producing.values():
            req = produce.request
            # num_computed_tokens counts this step's tokens: its forward completes these blocks
            done = min(req.num_computed_tokens, req.num_prompt_tokens) // bs
            done = min(done, len(produce.block_ids), len(req.block_hashes))
            self._orders.saves.extend(
                KVBlockRef(produce.block_ids[i], req.block_hashes[i])
                for i in range(produce.saved, done)
            )
            produce.saved = max(produce.saved, done)
        orders, self._orders = self._orders, PDOrders()
        return ENCODER.encode(orders)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid, tokens in output.finished_loading.items():
            if rid in self._loading:
                self._loading.discard(rid)
                self._loaded.add(rid)
                if tokens:
                    hits = self._stats.hit_tokens
                    hits[MEDIUM] = hits.get(MEDIUM, 0) + tokens
        if output.stats is not None:
            _add(self._stats, output.stats)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id  # the kernel holds the blocks of a request still loading
        self._consuming.pop(rid, None)
        self._loaded.discard(rid)
        self._loading.discard(rid)
        produce = self._producing.pop(rid, None)
        if produce is None or request.status not in _HANDED_OFF:
            return False, None
        handoff = PDHandoff(
            remote_engine_id=self.engine_id,
            num_tokens=produce.saved * self.block_size,
            namespace=self.namespace,
        )
        return False, msgspec.to_builtins(handoff)

    def take_events(self) -> list[Any]:
        return []  # the store is private to producers and their consumers: no router reads it

    def take_stats(self) -> KVTransferStats | None:
        stats, self._stats = self._stats, KVTransferStats()
        return stats if stats != KVTransferStats() else None

    def shutdown(self) -> None:
        self._producing.clear()
        self._consuming.clear()


def _add(total: KVTransferStats, part: KVTransferStats) -> None:
    """Add a worker's figures (deltas; its store's level replaces the last one) to ``total``."""
    total.load_bytes += part.load_bytes
    total.load_seconds += part.load_seconds
    total.save_bytes += part.save_bytes
    total.save_seconds += part.save_seconds
    total.failed_loads += part.failed_loads
    for tier, n in part.hit_tokens.items():
        total.hit_tokens[tier] = total.hit_tokens.get(tier, 0) + n
    total.tier_bytes.update(part.tier_bytes)
    total.tier_capacity_bytes.update(part.tier_capacity_bytes)
