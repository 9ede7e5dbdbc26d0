"""Build a real Scheduler + FakeExecutor pair and drive it step by step (no model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from baton.config import BatonConfig
from baton.protocol import EngineCoreOutput, SchedulerOutput
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.sched.policies import FCFSPolicy, PriorityPolicy
from baton.sched.scheduler import Scheduler
from baton.testing import FakeExecutor


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
    return Scheduler(cfg, pol, num_blocks, **kwargs)


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


class Driver:
    """schedule -> execute -> update, recording everything."""

    def __init__(
        self, scheduler: Scheduler, executor: FakeExecutor | None = None, **executor_kw: Any
    ) -> None:
        self.s = scheduler
        self.ex = executor or FakeExecutor(
            block_size=scheduler.block_size,
            num_blocks=scheduler.kv.pool.num_blocks,
            deep_check=True,
            **executor_kw,
        )
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, EngineCoreOutput] = {}
        self.outputs: list[EngineCoreOutput] = []
        self.scheduler_outputs: list[SchedulerOutput] = []
        self.preemptions = 0

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.s.add_request(r)

    def step(self) -> list[EngineCoreOutput]:
        so = self.s.schedule()
        self.scheduler_outputs.append(so)
        mro = self.ex.execute_model(so)
        outs = self.s.update_from_output(so, mro)
        self.preemptions += len(so.preempted_req_ids)
        self.record(outs)
        return outs

    def record(self, outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            assert o.request_id not in self.finished, f"{o.request_id} reported after it finished"
            self.outputs.append(o)
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[o.request_id] = o

    def run(self, max_steps: int = 10_000) -> Driver:
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                return self
            self.step()
        raise AssertionError(
            f"not finished after {max_steps} steps: {list(self.s.requests.values())}"
        )
