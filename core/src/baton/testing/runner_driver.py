"""A minimal hand-written scheduler that drives a ModelRunner in tests (not baton's scheduler).

It allocates blocks from a shuffled free list (so block ids are not contiguous),
schedules under a token budget with chunked prefill, can preempt, and can
start a request on a prefix whose KV another request already wrote.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from baton.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from baton.sampling_params import SamplingParams


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent_tokens: int = 0  # tokens the runner has been told about
    sent_blocks: int = 0
    is_new: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Driver:
    def __init__(
        self, runner, num_blocks: int, block_size: int, budget: int, seed: int = 0
    ) -> None:
        self.runner = runner
        self.bs = block_size
        self.budget = budget
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.running: list[Req] = []
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.step_id = 0
        self.all: dict[str, Req] = {}
        self.refs: dict[int, int] = {}  # block -> number of requests using it

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        params: SamplingParams | None = None,
        prefix_from: Req | None = None,
        prefix_tokens: int = 0,
    ) -> Req:
        r = Req(req_id, list(prompt), params or SamplingParams(temperature=0.0), max_tokens)
        if prefix_from is not None:  # borrow full blocks holding an identical prefix
            nb = prefix_tokens // self.bs
            r.blocks = prefix_from.blocks[:nb]
            for b in r.blocks:
                self.refs[b] += 1
            r.computed = nb * self.bs
        self.running.append(r)
        self.all[req_id] = r
        return r

    def preempt(self, r: Req) -> None:
        self._release(r)
        r.computed, r.sent_blocks = 0, 0
        r.is_new = True
        self.preempted.append(r.req_id)

    def _release(self, r: Req) -> None:
        for b in r.blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        r.blocks = []

    def step(self):
        budget = self.budget
        new, cached = [], CachedRequestData()
        num_sched: dict[str, int] = {}
        for r in self.running:
            if budget == 0:
                break
            n = min(r.num_tokens - r.computed, budget)
            need = -(-(r.computed + n) // self.bs) - len(r.blocks)
            if need > len(self.free):
                continue
            for _ in range(need):
                b = self.free.pop()
                self.refs[b] = 1
                r.blocks.append(b)
            num_sched[r.req_id] = n
            budget -= n
            if r.is_new:
                new.append(
                    NewRequestData(
                        req_id=r.req_id,
                        prompt_token_ids=r.prompt,
                        sampling_params=r.params,
                        block_ids=list(r.blocks),
                        num_computed_tokens=r.computed,
                        output_token_ids=list(r.output),
                    )
                )
                r.is_new = False
            else:
                cached.req_ids.append(r.req_id)
                cached.new_token_ids.append((r.prompt + r.output)[r.sent_tokens :])
                cached.new_block_ids.append(r.blocks[r.sent_blocks :])
                cached.num_computed_tokens.append(r.computed)
            r.sent_tokens = r.num_tokens
            r.sent_blocks = len(r.blocks)
        so = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            finished_req_ids=self.finished,
            preempted_req_ids=self.preempted,
        )
        self.finished, self.preempted = [], []
        self.step_id += 1
        out = self.runner.execute_model(so)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            r = self.all[rid]
            r.computed += num_sched[rid]
            if toks:
                r.output += toks
        for r in list(self.running):
            if r.done:
                self.running.remove(r)
                self._release(r)
                self.finished.append(r.req_id)
        return so, out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.running:
                return
            self.step()
        raise AssertionError("driver did not finish")
