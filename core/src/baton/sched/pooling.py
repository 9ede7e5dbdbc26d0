"""A pooling request's end in the scheduler: its pooled vector instead of a sampled token."""

from __future__ import annotations

from typing import Any

from baton.request import Request, RequestStatus


def take_pooled(req: Request, pooler_output: dict[str, Any] | None, step_id: int) -> Any:
    """The pooled vector of ``req``, whose prompt this step finished computing; the request
    is FINISHED_STOPPED, or FINISHED_ERROR (and None returned) when the runner pooled nothing."""
    pooled = pooler_output.get(req.request_id) if pooler_output else None
    if pooled is None:
        req.status = RequestStatus.FINISHED_ERROR
        req.error = (
            f"the model runner returned no pooled output for request {req.request_id!r} "
            f"at step {step_id}"
        )
        return None
    req.status = RequestStatus.FINISHED_STOPPED
    return pooled
