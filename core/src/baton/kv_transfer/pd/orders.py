"""The scheduler half's orders to the worker halves for one step (``kv_connector_metadata``)."""

from __future__ import annotations

import msgspec


class PDSave(msgspec.Struct, frozen=True, array_like=True):
    """Copy block ``block_id`` out to hand-off ``transfer_id`` as its block ``index``."""

    transfer_id: str
    index: int
    block_id: int
    block_hash: bytes


class PDLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Load a request's blocks ``first_index ...`` of hand-off ``transfer_id`` into
    ``block_ids`` (one per block, in order), waiting up to ``timeout`` seconds for missing ones."""

    request_id: str
    transfer_id: str
    first_index: int
    block_ids: list[int]
    block_hashes: list[bytes]
    timeout: float


class PDOrders(msgspec.Struct, kw_only=True, omit_defaults=True):
    saves: list[PDSave] = msgspec.field(default_factory=list)
    loads: list[PDLoad] = msgspec.field(default_factory=list)
    #: requests that ended while their load runs: report them in ``finished_saving`` once it
    #: is done (their blocks are held until then: a late copy must not hit a reused block)
    released: list[str] = msgspec.field(default_factory=list)


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(PDOrders)
