"""Workloads with arrival times and tenants for the scheduler simulator (chat-workload/v1 + arrival_time, user).

``bursty_two_tenant``: an *interactive* tenant sends short requests as a
steady Poisson stream while a *batch* tenant sends bursts of long requests
(every ``burst_every_s`` seconds, ``burst_size`` requests within a second).
Under first come, first served the interactive requests queue behind each
burst; the comparison of policies is about that.

``poisson``: one tenant, requests arriving as a Poisson stream at ``rate`` per
second with chat-like prompt and output lengths (workload.json's range), for
goodput under load: at a rate above what the engine sustains the queue grows,
and which requests meet their SLO is the policy's doing.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from baton_bench.common import Workload, WorkloadRequest

VOCAB = 49152


def bursty_two_tenant(
    seed: int = 0,
    duration_s: float = 360.0,
    interactive_rate: float = 0.3,
    interactive_prompt: tuple[int, int] = (32, 128),
    interactive_output: tuple[int, int] = (16, 48),
    burst_every_s: float = 120.0,
    burst_size: int = 80,
    batch_prompt: tuple[int, int] = (160, 320),
    batch_output: tuple[int, int] = (32, 96),
    prefix_len: int = 24,
) -> Workload:
    """The bursty two-tenant workload (see the module docstring). Deterministic for ``seed``."""
    rng = random.Random(seed)
    prefixes = {
        u: [rng.randrange(3, VOCAB) for _ in range(prefix_len)] for u in ("interactive", "batch")
    }

    def request(
        user: str, t: float, prompt: tuple[int, int], output: tuple[int, int]
    ) -> WorkloadRequest:
        n = rng.randint(*prompt)
        ids = prefixes[user][: min(prefix_len, n)] + [
            rng.randrange(3, VOCAB) for _ in range(n - prefix_len)
        ]
        return WorkloadRequest(
            id="",
            prompt_token_ids=ids,
            max_new_tokens=rng.randint(*output),
            arrival_time=round(t, 3),
            user=user,
        )

    reqs: list[WorkloadRequest] = []
    t = rng.expovariate(interactive_rate)
    while t < duration_s:
        reqs.append(request("interactive", t, interactive_prompt, interactive_output))
        t += rng.expovariate(interactive_rate)
    start = burst_every_s / 4
    while start < duration_s:
        for _ in range(burst_size):
            reqs.append(request("batch", start + rng.uniform(0.0, 1.0), batch_prompt, batch_output))
        start += burst_every_s
    reqs.sort(key=lambda r: r.arrival_time)
    for i, r in enumerate(reqs):
        r.id = f"{r.user}-{i}"
    return Workload(
        format="chat-workload/v1",
        name=f"bursty-two-tenant-seed{seed}",
        requests=reqs,
        sampling={"temperature": 0.0, "greedy": True, "ignore_eos": True},
    )


def poisson(
    seed: int = 0,
    rate: float = 1.0,
    duration_s: float = 240.0,
    prompt: tuple[int, int] = (32, 400),
    output: tuple[int, int] = (16, 160),
) -> Workload:
    """Poisson arrivals at ``rate`` requests/s for ``duration_s`` (see the module docstring)."""
    rng = random.Random(seed)
    reqs: list[WorkloadRequest] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        n = rng.randint(*prompt)
        reqs.append(
            WorkloadRequest(
                id=f"req-{len(reqs)}",
                prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(n)],
                max_new_tokens=rng.randint(*output),
                arrival_time=round(t, 3),
            )
        )
        t += rng.expovariate(rate)
    return Workload(
        format="chat-workload/v1",
        name=f"poisson-rate{rate:g}-seed{seed}",
        requests=reqs,
        sampling={"temperature": 0.0, "greedy": True, "ignore_eos": True},
    )


GENERATORS = {"bursty-two-tenant": bursty_two_tenant, "poisson": poisson}


def write_workload(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` as JSON (readable by ``load_workload`` and ``baton bench throughput``)."""
    data = msgspec.to_builtins(workload)
    for r in data["requests"]:
        r.pop("messages", None)
    Path(path).write_bytes(msgspec.json.encode(data) + b"\n")
