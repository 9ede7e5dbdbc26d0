"""EngineCoreClient: one interface, several faces.

- InprocClient: the core in this process, driven by the caller's thread (sync).
- AsyncInprocClient / SyncMPClient / AsyncMPClient live in baton.engine.mp_client,
  DPAsyncMPClient in baton.engine.dp_client: the core behind a transport plugin's channel.

``baton.engine.clients.make_client`` picks the face from the transport (``multiprocess``)
and the caller (asyncio or not).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.engine.utility_methods import UTILITY_METHODS
from baton.errors import InvalidRequestError
from baton.model_info import ModelInfo
from baton.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """What a frontend needs from an engine, wherever it runs."""

    info: ModelInfo

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until there is one)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` in the engine and return its result."""

    @abstractmethod
    def shutdown(self) -> None: ...

    # asyncio face; sync clients do not implement it
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} is synchronous; use make_client(..., asyncio_mode=True)"
        )

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} is synchronous")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} is synchronous")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is synchronous")


class InprocClient(EngineCoreClient):
    """The engine core in this process; ``get_output`` runs one step."""

    def __init__(self, config: BatonConfig, **core_kwargs: Any) -> None:
        self.core = EngineCore(config, **core_kwargs)
        self.info = self.core.info
        #: Outputs of steps taken outside get_output (an abort's flush), returned first.
        self._stashed: list[EngineCoreOutputs] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        core = self.core
        core.abort_requests(request_ids)
        # nothing steps an idle in-process engine until the next request: step now so the
        # runner drops the aborted requests (a batch queue needs a step per batch in flight)
        for _ in range(core.batch_queue_size + 1):
            if not core.scheduler.has_runner_news() and not core.batch_queue:
                break
            if core.scheduler.has_unfinished_requests():
                break  # the next get_output's step carries the news
            outputs, _ = core.step_fn()
            if outputs is not None:
                self._stashed.append(outputs)

    def get_output(self) -> EngineCoreOutputs:
        if self._stashed:
            return self._stashed.pop(0)
        outputs, _ = self.core.step_fn()
        return outputs or EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITY_METHODS:
            raise InvalidRequestError(
                f"unknown utility method {method!r} (known: {', '.join(sorted(UTILITY_METHODS))})"
            )
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()
