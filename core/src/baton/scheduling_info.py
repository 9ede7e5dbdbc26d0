"""SchedulingInfo: what a request tells the scheduler policy about itself.

A request carries its priority, a deadline, a tenant, free-form string tags
and latency targets (SLOs: time to first token, time per output token) to the
policy (``Request.scheduling``) from every entry point: ``LLM.generate(...,
scheduling=...)``, ``AsyncLLM.generate``, ``baton generate`` / ``baton chat``
(``--priority``, ``--deadline``, ``--tenant``, ``--tag KEY=VALUE``,
``--slo-ttft-ms``, ``--slo-tpot-ms``) and the OpenAI server (``priority`` and
``scheduling: {...}`` in the body, e.g. ``"scheduling": {"slo_ttft_ms": 500,
"slo_tpot_ms": 50}``). It crosses
the frontend -> engine boundary inside ``EngineCoreRequest``, so it is a
msgspec struct (an array on the wire: fields are only added, at the end).

The mechanism never orders by it; a policy may (the ``slo`` policy orders by the
SLOs). The scheduler counts goodput: how many finished requests with an SLO met
it (``baton.sched.slo``). Every field is bounded (the MAX_*
constants) and checked by ``baton.validation.check_scheduling``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import msgspec

from baton.errors import InvalidRequestError
from baton.sampling_params import show_value

#: A request's priority is an int64 (it crosses the msgpack boundary).
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
#: Most tags one request may carry.
MAX_TAGS = 16
#: Longest tag key and value, in characters.
MAX_TAG_KEY_CHARS = 64
MAX_TAG_VALUE_CHARS = 256
#: Longest tenant name, in characters.
MAX_TENANT_CHARS = 256
#: Longest deadline: 30 days, in seconds after arrival.
MAX_DEADLINE_S = 30 * 24 * 3600.0
#: Longest SLO target (time to first token, time per output token): one day, in milliseconds.
MAX_SLO_MS = 24 * 3600 * 1000.0


class SchedulingInfo(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True, frozen=True
):
    """A request's scheduling metadata, for the scheduler policy to read.

    ``priority``: an int64, lower first with the ``priority`` policy (as
    vLLM's). ``deadline``: seconds after the request's arrival by which it
    should finish (a latency budget, > 0; the policy sees the absolute time as
    ``Request.deadline_time`` on its own clock). ``tenant``: who the request
    is for (a fair-share key; ``fair`` takes it before ``user``). ``tags``:
    free-form ``{key: value}`` strings, at most ``MAX_TAGS``. ``slo_ttft_ms``:
    the time to first token the request should meet, in milliseconds after its
    arrival; ``slo_tpot_ms``: the time per output token after the first (the
    mean: (last token - first token) / (outputs - 1)). A request with either
    counts in the engine's goodput; both given, it meets its SLO when it meets
    both.
    """

    priority: int = 0
    deadline: float | None = None
    tenant: str | None = None
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


#: The field names, in wire order.
FIELDS = SchedulingInfo.__struct_fields__


def as_scheduling_info(value: Any, priority: int | None = None) -> SchedulingInfo:
    """``value`` (None, a SchedulingInfo or a mapping of its fields) with ``priority`` merged in.

    ``priority`` is the request's separate priority argument (vLLM's ``priority``),
    0 or None when not given. Given both ways with different non-zero values, it
    is refused. Field types and bounds are checked by
    ``baton.validation.check_scheduling``, not here.
    """
    if value is None:
        info = SchedulingInfo()
    elif isinstance(value, SchedulingInfo):
        info = value
    elif isinstance(value, Mapping):
        unknown = [k for k in value if k not in FIELDS]
        if unknown:
            key = unknown[0]
            named = isinstance(key, str) and len(key) <= MAX_TAG_KEY_CHARS
            raise InvalidRequestError(
                f"scheduling has no field {show_value(key, 40)}: use {', '.join(FIELDS)}",
                param=f"scheduling.{key}" if named else "scheduling",
            )
        info = SchedulingInfo(**value)
    else:
        raise InvalidRequestError(
            f"scheduling must be a SchedulingInfo or a mapping of its fields ({', '.join(FIELDS)}), "
            f"got {type(value).__name__}",
            param="scheduling",
        )
    if priority is None:
        return info
    check_priority(priority)
    if priority == 0 or priority == info.priority or not isinstance(info.priority, int):
        return info  # a bad scheduling.priority is check_scheduling's to report
    if info.priority == 0:
        return msgspec.structs.replace(info, priority=int(priority))
    raise InvalidRequestError(
        f"priority={show_value(priority)} and scheduling.priority={show_value(info.priority)} "
        "disagree: give the priority once",
        param="priority",
    )


def check_priority(priority: Any) -> None:
    """An int64 (lower values are served first by the priority policy)."""
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise InvalidRequestError(
            f"priority must be an integer, got {show_value(priority)} ({type(priority).__name__})",
            param="priority",
        )
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidRequestError(
            f"priority must be in [-2**63, 2**63) (an int64), got {show_value(priority)}",
            param="priority",
        )
