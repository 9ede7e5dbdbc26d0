"""The engine's step time as a linear function of what a step computes: the cost model.

One step of the engine costs

    step_overhead_s
    + prefill_s_per_token * (prompt tokens computed, incl. recompute after preemption)
    + decode_s_per_token  * (tokens generated one at a time)
    + attention_s_per_token_pair * sum over scheduled tokens of the context they attend to

The live scheduler's step-time model (``baton.sched.step_time_model``) starts from
``DEFAULT``; the scheduler simulator (baton-bench) replays workloads with it.
``baton bench scheduler --calibrate --cost-model-out FILE`` measures one on this machine.
"""

from __future__ import annotations

from typing import Any

import msgspec


class CostModel(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Seconds per step as a linear function of what the step computes (see the module docstring)."""

    step_overhead_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    attention_s_per_token_pair: float = 0.0
    #: Where the figures come from (e.g. "calibrated: ..." or "command line").
    source: str = ""
    #: The KV cache of the engine it was measured on (the simulator's default).
    num_blocks: int | None = None
    #: Fit quality and measurement context (free-form figures).
    fit: dict[str, Any] = msgspec.field(default_factory=dict)

    def step_cost(self, prefill: int, decode: int, pairs: int) -> float:
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * prefill
            + self.decode_s_per_token * decode
            + self.attention_s_per_token_pair * pairs
        )


#: Measured with ``--calibrate`` on the 2-core development machine: SmolLM2-135M-Instruct, float32,
#: uniproc, 1 torch thread, block 16, budget 2048 (fit: median relative error 7%, others_cpu_frac 0.39).
#: Replace it with your own: ``baton bench scheduler --calibrate --cost-model-out cost.json``.
DEFAULT = CostModel(
    step_overhead_s=0.0530,
    prefill_s_per_token=0.00233,
    decode_s_per_token=0.00393,
    attention_s_per_token_pair=9.26e-6,
    source="built-in default (SmolLM2-135M fp32, 1 thread, 2-core CPU); calibrate your own with --calibrate",
)


def step_features(requests: dict[str, Any], num_scheduled: dict[str, int]) -> tuple[int, int, int]:
    """(prefill tokens, decode tokens, attention pairs) of a step, after ``schedule()`` advanced the requests."""
    prefill = decode = pairs = 0
    for rid, n in num_scheduled.items():
        req = requests[rid]
        start = req.num_computed_tokens - n
        if n == 1 and start >= req.num_prompt_tokens:
            decode += 1
        else:
            prefill += n
        pairs += n * start + n * (n + 1) // 2
    return prefill, decode, pairs
