"""Admission: what the scheduler refuses at ``add_request`` (requests that could never run to
completion), and which waiting requests each step admits (``admit_waiting``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.errors import InvalidRequestError
from baton.protocol import EngineCoreEventType, NewRequestData
from baton.request import RequestStatus
from baton.sched.kv_transfer import KVConnectorCallError
from baton.validation import check_context_length

if TYPE_CHECKING:
    from baton.kv.block_pool import KVBlock
    from baton.kv.manager import KVCacheManager
    from baton.request import Request
    from baton.sched.scheduler import Scheduler
    from baton.sched.step_plan import StepPlan

_RUNNING = RequestStatus.RUNNING


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


def admit_waiting(sched: Scheduler, plan: StepPlan, now: float) -> None:
    """Admit waiting requests, in the policy's order, while budget, seats and blocks last."""
    policy = sched.policy
    running = sched.running
    max_partial = sched.max_num_partial_prefills
    # prompts admitted but not computed to their end by the steps scheduled so far
    num_partial = (
        sum(1 for r in running if r.status == _RUNNING and r.num_computed_tokens < r.num_tokens)
        if max_partial is not None
        else 0
    )
    loras: set[int] | None = None  # the running requests' adapters, once one is asked about
    while (
        plan.budget > 0
        and plan.prefill > 0
        and len(running) < sched.max_num_seqs
        and len(plan.num_scheduled) < sched.max_num_seqs_per_batch
    ):
        req = policy.peek(now)
        if req is None:
            break
        lora_id = req.lora_id
        if lora_id and sched.max_loras is not None:
            if loras is None:
                loras = {r.lora_id for r in running if r.status == _RUNNING} - {0}
            if lora_id not in loras and len(loras) >= sched.max_loras:
                break  # its adapter would be one too many in a batch: it waits its turn
        hits, num_hit = sched.kv.get_computed_blocks(req)
        ext, is_async = _external(sched, req, num_hit)
        if ext < 0:
            continue  # the KV connector raised: the request failed
        if is_async:  # it waits for its load, holding its blocks, and computes nothing yet
            if not _allocate(sched, req, ext, hits):
                break
            if _ordered(sched, req, num_hit, ext):
                sched.kv_transfer.park(req, num_hit, ext)  # type: ignore[union-attr]
            continue
        ntok = req.num_tokens
        n = _chunk(sched, plan, ntok - num_hit - ext)
        if n is None:
            break
        if max_partial is not None and num_hit + ext + n < ntok:
            if num_partial >= max_partial:
                break  # it would be one partial prefill too many: it waits its turn
            num_partial += 1
        reserve = ntok - num_hit if sched.reserve_full_prompt else ext + n
        if not _allocate(sched, req, reserve, hits):
            break
        if not _ordered(sched, req, num_hit, ext):
            continue
        _start_running(sched, plan, req, num_hit + ext, n, now)
        if lora_id and loras is not None:
            loras.add(lora_id)


def _external(sched: Scheduler, req: Request, num_hit: int) -> tuple[int, bool]:
    """Tokens the KV connector supplies after the pool's ``num_hit`` and whether they load
    asynchronously; (0, False) without a connector; (-1, False): it raised, the request failed."""
    kvt = sched.kv_transfer
    if kvt is None:
        return 0, False
    try:
        return kvt.lookup(req, num_hit)
    except KVConnectorCallError as e:
        kvt.fail_later(req, e.message)
        return -1, False


def _ordered(sched: Scheduler, req: Request, num_hit: int, num_external: int) -> bool:
    """Tell the KV connector the request's blocks are allocated; False: it raised, the request
    failed (its blocks released)."""
    kvt = sched.kv_transfer
    if kvt is None:
        return True
    try:
        kvt.allocated(req, num_hit, num_external)
    except KVConnectorCallError as e:
        kvt.fail_later(req, e.message)
        return False
    return True


def _chunk(sched: Scheduler, plan: StepPlan, n: int) -> int | None:
    """The tokens to compute this step of a waiting request with ``n`` left; None: it waits."""
    long_prefill = sched.long_prefill_token_threshold
    if long_prefill and n > long_prefill:
        n = long_prefill
    if n > plan.budget:
        # without chunked prefill a prompt waits for a step it fits in whole; one that
        # can never fit (a long request resumed after preemption) is chunked anyway
        if not sched.enable_chunked_prefill and n <= sched.max_num_batched_tokens:
            return None
        n = plan.budget
    return min(n, plan.prefill)  # the prefill cap binds only under target_step_ms


def _allocate(sched: Scheduler, req: Request, reserve: int, hits: list[KVBlock]) -> bool:
    """Blocks for ``reserve`` tokens of a waiting request, evicting retained forks if need be.

    Reserving the whole sequence's blocks (``reserve_full_prompt``) means its later prompt
    chunks never need one, so it cannot preempt itself mid-prompt (it waits until they are
    all free)."""
    kv = sched.kv
    allocated = kv.allocate_slots(req, reserve, hits)
    while allocated is None and sched.forks.evict_one():
        allocated = kv.allocate_slots(req, reserve, hits)
    if allocated is None:
        # a waiting fork must not hold blocks that nobody running will ever free
        sched.forks.unfork(req)
        return False
    return True


def _start_running(
    sched: Scheduler, plan: StepPlan, req: Request, num_hit: int, n: int, now: float
) -> None:
    """Move an admitted request to running with ``n`` tokens scheduled after ``num_hit`` hits."""
    rid = req.request_id
    tokens = req.all_token_ids
    ntok = len(tokens)
    sched.policy.pop(req)
    req.status = _RUNNING
    sched.running.append(req)
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = num_hit
    req.record_event(EngineCoreEventType.SCHEDULED, now)
    plan.new_reqs.append(
        NewRequestData(
            req_id=rid,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            block_ids=list(sched.kv.get_block_ids(rid)),
            num_computed_tokens=num_hit,
            output_token_ids=tokens[req.num_prompt_tokens :],
            pooling_params=req.pooling_params,
            lora_request=req.lora_request,
        )
    )
    sched.num_sent[rid] = ntok
    plan.num_scheduled[rid] = n
    plan.budget -= n
    plan.prefill -= n
    req.num_computed_tokens = num_hit + n
    if req.grammar is not None and num_hit + n == ntok:
        plan.so_ids.append(rid)
