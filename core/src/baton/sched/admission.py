"""What the scheduler refuses at ``add_request``: requests that could never run to completion."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.errors import InvalidRequestError
from baton.validation import check_context_length

if TYPE_CHECKING:
    from baton.kv.manager import KVCacheManager
    from baton.request import Request


def check_request(
    request: Request,
    *,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    enable_chunked_prefill: bool,
    kv: KVCacheManager,
) -> None:
    """Raise InvalidRequestError (naming the limit and the fix) if ``request`` cannot be served."""
    rid, n = request.request_id, request.num_prompt_tokens
    # the prompt alone (the engine core already checked prompt + max_tokens; a request given to
    # the scheduler directly stops at max_model_len), with the frontend's boundary and message
    check_context_length(n, None, max_model_len)
    if not enable_chunked_prefill and n > max_num_batched_tokens:
        raise InvalidRequestError(
            f"request {rid!r}: prompt of {n} tokens exceeds scheduler.max_num_batched_tokens "
            f"({max_num_batched_tokens}) and chunked prefill is off; enable "
            "scheduler.enable_chunked_prefill or raise max_num_batched_tokens"
        )
    # a request that outgrows the whole cache would preempt itself forever; its last sampled
    # token is never fed back, so it needs KV slots for prompt + max_tokens - 1 tokens (as vLLM)
    max_len = n + max(request.max_tokens, 1) - 1
    if max_model_len is not None:
        max_len = max(n, min(max_len, max_model_len - 1))
    if not kv.can_fit(max_len):
        raise InvalidRequestError(
            f"request {rid!r}: up to {max_len} tokens need more KV blocks than the cache has "
            f"({kv.num_total_blocks} blocks of {kv.block_size}); lower max_tokens, "
            "model.max_model_len, or give the cache more memory"
        )
