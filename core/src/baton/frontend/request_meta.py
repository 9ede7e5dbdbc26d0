"""What a request carries besides its prompt and parameters, as one struct.

``LLM`` and ``AsyncLLM`` take these as keyword arguments (``priority``, ``user``,
``scheduling``, ``trace_headers``, ``lora_request``: their public signatures); inside the
frontend they travel together as a ``RequestMeta``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from baton.lora.request import LoRARequest
from baton.scheduling_info import SchedulingInfo


class RequestMeta(msgspec.Struct, frozen=True, kw_only=True):
    """One request's metadata, as the caller gave it (``lora_request`` already checked)."""

    priority: int = 0
    """For the scheduler policy (lower first); merged into ``scheduling``'s priority."""
    user: str | None = None
    """The end user, for the policy and the stats."""
    scheduling: SchedulingInfo | Mapping[str, Any] | None = None
    """A SchedulingInfo or a dict of its fields (deadline, tenant, tags, SLOs)."""
    trace_headers: Mapping[str, str] | None = None
    """The caller's trace context (``traceparent``, ``tracestate``) for the request's span."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with; None: the base model."""

    @property
    def schedules(self) -> bool:
        """Whether any of the scheduler's fields (priority, user, scheduling) was given."""
        return self.priority != 0 or self.user is not None or self.scheduling is not None
