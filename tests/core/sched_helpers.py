"""A real Scheduler and requests for the kernel's own tests, driven by
``baton.testing.sched_harness.SchedulerDriver`` (no model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from baton.config import BatonConfig
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.sched.policies import FCFSPolicy, PriorityPolicy
from baton.sched.scheduler import Scheduler


def make_config(**overrides: Any) -> BatonConfig:
    base = dict(max_num_seqs=16, max_num_batched_tokens=256, block_size=16)
    base.update(overrides)
    return BatonConfig.load(**base)


def make_scheduler(
    num_blocks: int = 256,
    policy: str = "fcfs",
    clock: Callable[[], float] | None = None,
    max_model_len: int | None = 4096,
    **overrides: Any,
) -> Scheduler:
    cfg = make_config(**overrides)
    pol = FCFSPolicy() if policy == "fcfs" else PriorityPolicy()
    kwargs: dict[str, Any] = {"max_model_len": max_model_len}
    if clock is not None:
        kwargs["clock"] = clock
    return Scheduler(cfg.scheduler, cfg.cache, pol, num_blocks, **kwargs)


def make_request(
    rid: str,
    prompt: list[int] | int,
    *,
    eos: int | None = 0,
    priority: int = 0,
    arrival: float = 0.0,
    salt: str | None = None,
    max_model_len: int | None = None,
    **params: Any,
) -> Request:
    if isinstance(prompt, int):
        seed = sum(map(ord, rid))  # distinct ids, distinct prompts
        prompt = [(7 * i + 13 * seed) % 997 + 1 for i in range(prompt)]
    params.setdefault("max_tokens", 8)
    return Request(
        rid,
        list(prompt),
        SamplingParams(**params),
        eos_token_id=eos,
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt,
        max_model_len=max_model_len,
    )
