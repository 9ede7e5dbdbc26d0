"""/health without waiting on an engine step.

``engine.check_health()`` is a round trip to the engine's busy loop, which
answers between two steps: on a busy engine that is a whole step (a long
prefill on CPU takes seconds). So /health starts a check when none is under
way and waits for it only briefly: an idle engine gives a fresh answer at
once, a busy one the latest known answer. The engine is unhealthy when it is
dead, when its latest check failed, or when a check has been waiting longer
than ``timeout`` (a wedged loop), as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from baton import AsyncLLM
from baton.errors import BatonError
from baton_openai.http.errors import OpenAIError

#: How long /health waits for a check under way before it answers with the latest result.
FRESH_WAIT_S = 0.02


class EngineHealth:
    """The engine's health as /health reports it; ``await check()`` raises a 503 when unhealthy."""

    def __init__(self, engine: AsyncLLM, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout
        self._pending: asyncio.Future[None] | None = None
        self._pending_since = 0.0
        self._failure: str | None = None

    async def check(self) -> None:
        if self.engine.errored:
            raise _unhealthy(f"EngineDeadError: {self.engine.dead_error}")
        if self._pending is None:
            self._pending_since = time.monotonic()
            self._pending = asyncio.ensure_future(self._ping())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._pending), FRESH_WAIT_S)
        if self._failure is not None:
            raise _unhealthy(self._failure)
        waited = time.monotonic() - self._pending_since
        if self._pending is not None and waited > self.timeout:
            raise _unhealthy(
                f"TimeoutError: the engine has not answered a health check for {waited:.0f} s"
            )

    async def _ping(self) -> None:
        try:
            await self.engine.check_health()
        except BatonError as e:
            self._failure = f"{type(e).__name__}: {e}"
        else:
            self._failure = None
        finally:
            self._pending = None


def _unhealthy(why: str) -> OpenAIError:
    return OpenAIError(f"unhealthy: {why}", 503, code="engine_unavailable")
