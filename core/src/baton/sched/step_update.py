"""The update from a step's output: one request's sampled tokens (or pooled vector) applied.

``Scheduler.update_from_output`` walks the step's requests; for each, ``apply_step``
takes back rejected draft tokens, appends the sampled tokens with their stop checks
(``sched/stop.py``), registers full blocks in the prefix cache and builds the request's
EngineCoreOutput (None for a prompt chunk, which has nothing to report yet).

With a speculator (``speculative.method``, ``baton.speculative.drafting``) a running
request about to decode may be scheduled with draft tokens: ``1 + k`` tokens,
counted in the budget and given KV slots like any others, its
``num_computed_tokens`` advanced by all of them. The runner verifies the drafts
and returns those it accepted plus one token of its own; ``apply_step`` then
takes the rejected ones back from ``num_computed_tokens`` (their slots are
overwritten later; their blocks stay the request's). A step of several decode steps
(``sched/decode_steps.py``) returns up to that many tokens a request; the positions of all but
the last of those kept after the stop checks count as computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from baton.errors import ExecutorError
from baton.kv.hashing import update_block_hashes
from baton.protocol import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from baton.request import Request, RequestStatus
from baton.sched.pooling import take_pooled
from baton.sched.stop import append_and_check_stop

if TYPE_CHECKING:
    from baton.sched.scheduler import Scheduler
    from baton.speculative.drafting import Drafts

_FINISHED = RequestStatus.FINISHED_STOPPED  # every status >= this one is finished
_ERROR = RequestStatus.FINISHED_ERROR


class RunnerStep(msgspec.Struct, kw_only=True):
    """A step's ModelRunnerOutput by request id (all empty when the step returned none)."""

    sampled: dict[str, list[int]] = msgspec.field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    pooler_output: dict[str, Any] | None = None
    #: Requests the runner left out, with the reason: their KV for this step is unwritten.
    failed: dict[str, str] | None = None

    @classmethod
    def of(cls, out: ModelRunnerOutput | None) -> RunnerStep:
        if out is None:
            return cls()
        sampled = dict(zip(out.req_ids, out.sampled_token_ids, strict=True)) if out.req_ids else {}
        return cls(
            sampled=sampled,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            pooler_output=out.pooler_output,
            failed=out.failed,
        )


def apply_step(
    sched: Scheduler,
    req: Request,
    n: int,
    step_id: int,
    runner: RunnerStep,
    drafts: list[int] | None,
    now: float,
    decode_steps: int = 1,
) -> EngineCoreOutput | None:
    """Apply the step that computed ``n`` tokens of ``req`` (with ``drafts`` verified, if any;
    in up to ``decode_steps`` decode steps, ``sched/decode_steps.py``); its output, or None for
    a prompt chunk. The caller releases a finished request."""
    rid = req.request_id
    tokens = req.all_token_ids
    computed = req.num_computed_tokens
    if drafts:  # computed: after the accepted drafts (appended below)
        assert sched.drafts is not None
        computed, n = take_back_rejected(sched.drafts, req, drafts, runner.sampled.get(rid))
    caching, bs = sched.enable_caching, sched.block_size
    new = pooled = None
    if req.pooling_params is not None and computed == len(tokens):
        new, pooled = [], take_pooled(req, runner.pooler_output, step_id)
    elif computed == len(tokens) or drafts:  # this step reached the end: it sampled
        new = runner.sampled.get(rid)
        if not new:
            req.status = _ERROR
            req.error = f"the model runner returned no token for request {rid!r} at step {step_id}"
            new = []
        else:
            if not drafts and len(new) > decode_steps:
                raise ExecutorError(
                    f"request {rid!r}: the runner returned {len(new)} tokens for a step of "
                    f"{decode_steps} decode step(s)"
                )
            new = append_and_check_stop(req, new, sched.max_model_len)
            if len(new) > 1 and not drafts:  # it computed the positions of the tokens it fed back
                req.num_computed_tokens = computed = computed + len(new) - 1
                n += len(new) - 1
            if req.first_token_time is None:
                req.first_token_time = now
        if sched.hash_blocks and len(tokens) // bs > len(req.block_hashes):
            update_block_hashes(req, bs)
    if caching and computed // bs != (computed - n) // bs:
        sched.kv.cache_blocks(req, computed)
    if new is None:
        return None  # a prompt chunk: nothing to report yet
    status = req.status
    finished = status >= _FINISHED
    events = req.events
    if events is not None:
        req.events = None
    return EngineCoreOutput(
        request_id=rid,
        new_token_ids=new,
        new_logprobs=runner.logprobs.get(rid) if runner.logprobs else None,
        finish_reason=status.finish_reason if finished else None,
        stop_reason=req.stop_reason,
        num_cached_tokens=req.num_cached_tokens,
        events=events,
        error=req.error,
        new_prompt_logprobs=runner.prompt_logprobs.get(rid) if runner.prompt_logprobs else None,
        pooling_output=pooled,
    )


def take_back_rejected(
    book: Drafts, req: Request, drafts: list[int], new: list[int] | None
) -> tuple[int, int]:
    """After verifying ``drafts``: ``num_computed_tokens`` less the rejected drafts, and
    the tokens the step really computed. The runner returned the accepted drafts and one
    token of its own (``new``); without tokens the request fails in the caller."""
    k = len(drafts)
    accepted = min(k, len(new) - 1) if new else 0
    if new and new[:accepted] != drafts[:accepted]:
        raise ExecutorError(
            f"request {req.request_id!r}: the runner returned {new} for drafts {drafts}: "
            "accepted tokens must be the drafts' prefix"
        )
    req.num_computed_tokens -= k - accepted
    if new:
        book.verified(req, k, accepted)
    return req.num_computed_tokens, 1 + accepted
