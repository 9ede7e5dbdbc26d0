"""The scheduler half's orders to the worker halves for one step (``build_connector_meta``)."""

from __future__ import annotations

import msgspec

from baton.kv_transfer.connector import KVBlockRef


class LoadOrder(msgspec.Struct, array_like=True):
    """Load a request's blocks: ``ram`` ones synchronously (before the forward), then ``disk``
    ones in the background (the request waits for ``finished_loading``; async iff any)."""

    req_id: str
    ram: list[KVBlockRef]
    disk: list[KVBlockRef]


class SaveOrder(msgspec.Struct, array_like=True):
    """Copy a block the step computed into RAM (after dropping ``evict``, RAM's least recently
    used blocks it displaces) and/or write it to disk."""

    block_id: int
    block_hash: bytes
    ram: bool
    disk: bool
    evict: list[bytes] = msgspec.field(default_factory=list)


class StepOrders(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Run in this order: cancel, loads (``start_step``), saves (``finish_step``)."""

    #: requests whose background loads must stop before the forward (they ended: their blocks
    #: may be another request's from this step on)
    cancel_loads: list[str] = msgspec.field(default_factory=list)
    loads: list[LoadOrder] = msgspec.field(default_factory=list)
    saves: list[SaveOrder] = msgspec.field(default_factory=list)


encode_orders = msgspec.msgpack.Encoder().encode
decode_orders = msgspec.msgpack.Decoder(StepOrders).decode
