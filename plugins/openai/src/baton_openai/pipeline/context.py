"""What every handler needs: the engine, the served model's name and limits, the checks they share."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

from baton import AsyncLLM
from baton.lora import LoRARequest
from baton_openai.http.admission import QueueGate
from baton_openai.http.errors import OpenAIError
from baton_openai.parsing.tool_parsers import HermesToolParser
from baton_openai.parsing.types import ReasoningParser, ToolParser
from baton_openai.templates.preprocess import Preprocessor

if TYPE_CHECKING:
    from baton_openai.endpoints.lora import LoRARegistry

log = logging.getLogger("baton_openai")


class RouteRequest(Protocol):
    """What check_request reads of a request body (every /v1, /tokenize and /detokenize model)."""

    model: str | None

    def ignored_fields(self) -> list[str]: ...


@dataclass
class ServerContext:
    engine: AsyncLLM
    model_name: str
    max_model_len: int
    #: Templating and tokenization off the event loop, within server.preprocess_timeout.
    preprocess: Preprocessor
    api_key: str | None = None
    #: The prometheus stat logger the engine feeds (None when stats are off).
    metrics: Any = None
    #: Requests waiting for their first token (server.max_queued_requests).
    queue: QueueGate = field(default_factory=lambda: QueueGate(None))
    #: Reads tool calls out of answers (server.tool_call_parser).
    tool_parser: ToolParser = field(default_factory=HermesToolParser)
    #: Splits reasoning out of answers (server.reasoning_parser); None: answers left whole.
    reasoning_parser: ReasoningParser | None = None
    #: LoRA adapters by model name (server.lora_modules, /v1/load_lora_adapter); None: none.
    loras: LoRARegistry | None = None

    @classmethod
    def of(cls, request: Request) -> ServerContext:
        return request.app.state.baton  # type: ignore[no-any-return]

    def check_request(self, req: RouteRequest) -> LoRARequest | None:
        """The checks before any work: the engine is alive and the model is ours. Returns the
        LoRA adapter the request's ``model`` names (None: the served model)."""
        if self.engine.errored:
            raise OpenAIError(
                f"the engine is dead: {self.engine.dead_error}", 503, code="engine_unavailable"
            )
        lora = None
        if req.model is not None and req.model != self.model_name:
            lora = self.loras.get(req.model) if self.loras is not None else None
            if lora is None:
                adapters = sorted(self.loras.by_name) if self.loras is not None else []
                also = f" or the LoRA adapters {', '.join(adapters)}" if adapters else ""
                raise OpenAIError(
                    f"The model `{req.model}` does not exist; this server serves "
                    f"{self.model_name!r}{also}",
                    404,
                    param="model",
                    code="model_not_found",
                )
        ignored = req.ignored_fields()
        if ignored:
            log.warning("ignoring unsupported request fields: %s", ", ".join(ignored))
        return lora

    def answering_model(self, req: RouteRequest) -> str:
        """The model name a response carries: the adapter's when the request named one."""
        lora = self.lora_for(req)
        return lora.lora_name if lora is not None else self.model_name

    def lora_for(self, req: RouteRequest) -> LoRARequest | None:
        """The LoRA adapter a checked request's ``model`` names (None: the served model)."""
        if req.model is None or req.model == self.model_name or self.loras is None:
            return None
        return self.loras.get(req.model)


async def check_api_key(request: Request) -> None:
    """A FastAPI dependency on /v1 routes: the key (server.api_key, when one is set) as
    ``Authorization: Bearer <key>`` or, as Anthropic's clients send it, ``x-api-key: <key>``."""
    key = ServerContext.of(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")
    if given is None or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise OpenAIError(
            "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            401,
            code="invalid_api_key",
        )
