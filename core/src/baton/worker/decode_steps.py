"""The model runner's side of several decode steps in one call (``SchedulerOutput.decode_steps``).

After the step's own token, each request's token is fed back and the next one picked by
argmax, up to ``decode_steps`` tokens a request (``sched/decode_steps.py`` says when the
scheduler asks). Each step after the first is the one before advanced by a position
(``StepInputBuilder.advance``); the batch learns of the tokens from the next SchedulerOutput, as
it does of any sampled token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from baton.protocol import ModelRunnerOutput, SchedulerOutput
from baton.worker.sampler import argmax_rows

if TYPE_CHECKING:
    from baton.worker.model_runner import ModelRunner
    from baton.worker.step_inputs import StepInputs


def decode_ahead(
    runner: ModelRunner, so: SchedulerOutput, inputs: StepInputs, out: ModelRunnerOutput
) -> ModelRunnerOutput:
    """``out`` (the step's sampled tokens) with up to ``so.decode_steps - 1`` more tokens a
    request; ``out`` itself unless the step was decodes alone, each request's token picked by
    argmax alone (``inputs.argmax_only``), on a runner that runs alone, and every request has
    KV slots (the blocks the scheduler sent) and room in max_model_len for more."""
    b = runner.input_batch
    rids = inputs.sample_req_ids
    n = len(rids)
    if (
        not inputs.argmax_only
        or inputs.drafts
        or inputs.attn.prefills
        or n != len(inputs.req_ids)
        or n != int(inputs.input_ids.shape[0])
        or out.failed
        or out.logprobs is not None
        or not runner.hooks.runs_alone()
        or not runner.hooks.samples()
    ):
        return out
    rows = inputs.sample_rows
    computed = b.num_computed_tokens[rows]
    ntok = b.num_tokens[rows]
    room = np.minimum(b.num_blocks[rows] * b.block_size - computed, b.max_model_len - ntok)
    k = min(so.decode_steps, int(room.min()))
    sampled = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
    picked = [list(sampled.get(rid, ())) for rid in rids]
    if k <= 1 or any(len(p) != 1 for p in picked):
        return out
    step = inputs
    for _ in range(1, k):
        step = runner.inputs.advance(step, [p[-1] for p in picked])
        tokens = argmax_rows(runner.forward(step)[:n]).tolist()
        for p, tok in zip(picked, tokens, strict=True):
            p.append(tok)
    by_rid = dict(zip(rids, picked, strict=True))
    return ModelRunnerOutput(
        req_ids=out.req_ids,
        sampled_token_ids=[by_rid[rid] for rid in out.req_ids],
        kv_connector=out.kv_connector,
    )
