"""Several decode steps in one engine step (``scheduler.decode_steps``, vLLM's multi-step).

A step whose every request decodes one token and reads nothing of its logits but the argmax
(``SamplingParams.argmax_only``), while no request waits, may let the model runner decode
``k`` tokens a request in one call: it picks a token, feeds it back, and so on ``k`` times.
The engine's per-step work (scheduling, the hand-off to the executor, sampling metadata, output
processing: ~1 ms of a ~6 ms batch-1 decode step on two CPU cores) is then paid once for ``k``
tokens. Only small batches do it (``MAX_ROWS``): there that work is a large part of a step, and
each output then carries ``k`` tokens, so a stream's tokens come ``k`` at a time.

The scheduler schedules each request's one token as usual, takes KV slots for ``k`` and sets
``SchedulerOutput.decode_steps``; ``apply_step`` counts the positions the runner computed
for the tokens it fed back (``num_computed_tokens``), after the stop checks, which cut the
tokens after a stop as they cut a speculative step's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.sched.scheduler import Scheduler
    from baton.sched.step_plan import StepPlan

#: Most requests a step may decode several tokens of. A step's fixed cost (~1 ms on two CPU
#: cores) is ~15% of a batch-1 decode step of SmolLM2-135M and ~5% of an 8-row one; with more
#: rows the gain no longer pays for streams that arrive k tokens at a time.
MAX_ROWS = 4


def plan_decode_steps(sched: Scheduler, plan: StepPlan) -> int:
    """The decode steps this step runs (1: one), with the KV slots taken for them.

    Several only when ``scheduler.decode_steps`` allows, every unfinished request is in the
    step (one waiting would wait the longer), it admitted and preempted nothing, no speculator
    or KV connector runs, and each of its at most
    ``MAX_ROWS`` requests decodes one token with ``argmax_only`` sampling, no grammar and no
    pooling; as many as every request's max_tokens and max_model_len leave. Slots come from free
    blocks only: when they run short the step decodes once (blocks taken stay the request's).
    """
    k = sched.decode_steps
    scheduled = plan.num_scheduled
    if (
        k <= 1
        or not scheduled
        or len(scheduled) > MAX_ROWS
        or plan.new_reqs
        or plan.preempted
        or plan.spec
        or plan.so_ids
        or len(sched.requests) != len(scheduled)  # one waits, or is in flight
        or sched.drafts is not None
        or sched.kv_transfer is not None
    ):
        return 1
    requests = sched.requests
    max_model_len = sched.max_model_len or 2**31
    for rid, n in scheduled.items():
        req = requests[rid]
        ntok = req.num_tokens
        if (
            n != 1
            or plan.cached[rid][2] != ntok - 1  # not its last token (a prompt chunk)
            or req.grammar is not None
            or req.pooling_params is not None
            or not req.sampling_params.argmax_only
        ):
            return 1
        k = min(k, req.max_tokens - (ntok - req.num_prompt_tokens), max_model_len - ntok)
        if k <= 1:
            return 1
    for rid in scheduled:
        ids = sched.kv.allocate_slots(requests[rid], k - 1)
        if ids is None:
            return 1
        plan.cached[rid][1].extend(ids)
    return k
