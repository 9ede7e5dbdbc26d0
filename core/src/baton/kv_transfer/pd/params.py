"""The ``kv_transfer_params`` of a prefill/decode hand-off, in vLLM's field names.

A client (``baton pd-proxy``) asks the producer with ``{"do_remote_decode": true}``; the
producer's response carries a ``PDHandoff`` (``do_remote_prefill: true``, how many prompt
tokens it saved); the client sends that to a consumer with the original request. The consumer
looks the blocks up by its own block hashes (which cover the prompt, the cache salt and the
LoRA adapter), so a client cannot make it load the KV of another prompt or model: the params
say only that a producer saved the prompt and how much of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from baton.errors import InvalidRequestError

PARAM = "kv_transfer_params"
#: The tier name of the shared store in ``KVTransferStats`` (hits, occupancy).
MEDIUM = "PD"


class PDHandoff(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a producer returns and a consumer loads from (``kv_transfer_params``)."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    #: the producer's engine id (vLLM's name), for logs and errors
    remote_engine_id: str
    #: prompt tokens the producer saved (whole blocks, from the prompt's first token)
    num_tokens: int
    #: ``KVNamespace.key`` of the producer: the consumer refuses another model's KV
    namespace: str


def wants_save(params: Mapping[str, Any] | None) -> bool:
    """The request asks this engine to prefill for a remote decode (``do_remote_decode``)."""
    return params is not None and params.get("do_remote_decode") is True


def wants_load(params: Mapping[str, Any] | None) -> bool:
    """The request brings a remote prefill to load (``do_remote_prefill``)."""
    return params is not None and params.get("do_remote_prefill") is True


def parse_handoff(params: Mapping[str, Any], namespace: str, block_size: int) -> PDHandoff:
    """A consumer's ``kv_transfer_params`` checked; InvalidRequestError names what is wrong."""
    try:
        handoff = msgspec.convert(dict(params), PDHandoff)
    except msgspec.ValidationError as e:
        raise InvalidRequestError(
            f"{PARAM} is not a pd hand-off ({e}): send the kv_transfer_params of the "
            "producer's response unchanged",
            param=PARAM,
        ) from None
    if handoff.num_tokens < 0 or handoff.num_tokens % block_size:
        raise InvalidRequestError(
            f"{PARAM}.num_tokens = {handoff.num_tokens} is not a whole number of blocks of "
            f"{block_size} tokens: send the producer's kv_transfer_params unchanged",
            param=PARAM,
        )
    if handoff.namespace != namespace:
        raise InvalidRequestError(
            f"{PARAM}.namespace = {handoff.namespace!r} is another model, KV dtype, block size "
            f"or parallel layout than this engine's ({namespace!r}): send the request to a "
            "consumer that serves the producer's model with the same settings",
            param=PARAM,
        )
    return handoff
