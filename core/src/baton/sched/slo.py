"""Per-request latency targets (SLOs): deadlines, feasibility, and whether a request met its own.

A request's SLO is ``scheduling.slo_ttft_ms`` (time to first token after its
arrival) and ``scheduling.slo_tpot_ms`` (mean time per output token after the
first), either or both. The scheduler stamps ``Request.first_token_time`` on
its clock and, when a request with an SLO finishes (stopped, length-capped or
failed; an abort is the client's choice and not counted), counts it and
whether it met its SLO: *goodput* is the rate of those that did. The times are
the engine's (its clock, from the request's ``arrival_time``): the frontend
adds its own detokenizing and transport delay on top.

Feasibility is what a policy needs to stop spending on requests that can no
longer meet their SLO: a waiting request whose first token is not out yet is
hopeless once its TTFT deadline has passed; a running one whose tokens so far
already took longer than its TPOT target allows over its whole ``max_tokens``
(even if the rest came at no cost) is hopeless too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.request import Request


def has_slo(request: Request) -> bool:
    """Whether the request carries a TTFT or a TPOT target."""
    info = request.scheduling
    return info.slo_ttft_ms is not None or info.slo_tpot_ms is not None


def ttft_deadline(request: Request) -> float | None:
    """When its first token is due, on the scheduler's clock; None: no TTFT target."""
    ttft = request.scheduling.slo_ttft_ms
    return None if ttft is None else request.arrival_time + ttft / 1000.0


def is_hopeless(request: Request, now: float) -> bool:
    """Whether the request can no longer meet its SLO, whatever is done from ``now`` on."""
    first = request.first_token_time
    if first is None:
        deadline = ttft_deadline(request)
        return deadline is not None and now > deadline
    tpot = request.scheduling.slo_tpot_ms
    if tpot is None or request.max_tokens <= 1:
        return False
    return now - first > tpot / 1000.0 * (request.max_tokens - 1)


def met_slo(request: Request, finished: float) -> bool:
    """Whether a request that finished at ``finished`` met its SLO (both targets it has).

    A request that produced no token (failed) did not; with one token its TPOT is met.
    """
    info = request.scheduling
    first = request.first_token_time
    if first is None:
        return False
    if info.slo_ttft_ms is not None and first - request.arrival_time > info.slo_ttft_ms / 1000.0:
        return False
    n = request.num_output_tokens
    if info.slo_tpot_ms is not None and n > 1:
        return (finished - first) / (n - 1) <= info.slo_tpot_ms / 1000.0
    return True
