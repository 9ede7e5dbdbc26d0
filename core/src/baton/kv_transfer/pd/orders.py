"""The scheduler half's orders to the worker halves for one step (``kv_connector_metadata``)."""

from __future__ import annotations

import msgspec

from baton.kv_transfer.connector import KVBlockRef


class PDLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Load a request's blocks (in order) from the store, waiting up to ``timeout`` seconds
    for one not written yet."""

    request_id: str
    blocks: list[KVBlockRef]
    timeout: float


class PDOrders(msgspec.Struct, kw_only=True, omit_defaults=True):
    #: blocks to copy into the store after this step's forward
    saves: list[KVBlockRef] = msgspec.field(default_factory=list)
    loads: list[PDLoad] = msgspec.field(default_factory=list)


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(PDOrders)
