"""Per-request fault containment in the model runner: how a request's failure is reported
and logged (once, where it was caught); the step goes on for the others."""

from __future__ import annotations

import logging

log = logging.getLogger("baton.worker.model_runner")  # the runner's: its messages keep their logger


def describe(error: BaseException) -> str:
    """How a request's failure is reported: ``"ExceptionType: message"``."""
    return f"{type(error).__name__}: {error}"


def log_contained(req_id: str, what: str, error: BaseException) -> None:
    """Log a failure attributed to one request (once, where it was caught)."""
    log.warning("request %s failed %s: %s", req_id, what, describe(error))
    log.debug("request %s: traceback", req_id, exc_info=error)
