"""What a router reads: the request to place and each engine's load."""

from __future__ import annotations

import msgspec


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request about to be sent to an engine core."""

    request_id: str
    prompt_token_ids: list[int]
    #: Mixed into prefix-cache block hashes: requests with different salts share no KV.
    cache_salt: str | None = None
    user: str | None = None
    priority: int = 0
    #: The engines' KV block size (prefix caching shares whole blocks of this many tokens).
    block_size: int = 16
    #: The LoRA adapter's id (LoRARequest.lora_int_id; 0: none): it is in the block hashes too.
    lora_int_id: int = 0


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One engine core as the client sees it when a request arrives."""

    engine_index: int
    #: Requests routed to it that have not finished (the client's own count: always current).
    num_in_flight: int = 0
    #: From its latest scheduler stats (one step behind at most).
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    #: Prompt tokens looked up in its prefix cache so far, and of those found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
