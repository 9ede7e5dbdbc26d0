"""LoRA adapters as model names (vLLM's): /v1/models lists them, a request's ``model`` picks one.

``server.lora_modules`` (``--lora-modules name=path``) names adapters at start; with
``server.allow_runtime_lora_updating`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` adds one and
``POST /v1/unload_lora_adapter {"lora_name"}`` removes one. Each name gets an adapter id of
its own (a name loaded again after an unload gets a new one); the engine reads an adapter when
it is added here (one engine) or when a request first names it (data parallel).
"""

from __future__ import annotations

import itertools
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from baton.errors import InvalidRequestError
from baton.lora import LoRARequest
from baton.lora.adapter import read_adapter_config
from baton_openai.http.errors import OpenAIError
from baton_openai.http.openapi import error_responses
from baton_openai.pipeline.context import ServerContext

log = logging.getLogger("baton_openai")


class LoRARegistry:
    """The adapters this server offers, by model name."""

    def __init__(self, base_name: str, max_lora_rank: int) -> None:
        self.base_name = base_name
        self.max_lora_rank = max_lora_rank
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def make(self, name: str, path: str) -> LoRARequest:
        """A new adapter's request, its folder checked (not registered yet: ``add``)."""
        if not name or not name.strip():
            raise OpenAIError("lora_name must not be empty", param="lora_name")
        if name == self.base_name:
            raise OpenAIError(
                f"lora_name {name!r} is the served model's name; pick another",
                param="lora_name",
            )
        if name in self.by_name:
            raise OpenAIError(
                f"The lora adapter '{name}' has already been loaded.",
                param="lora_name",
                code="invalid_value",
            )
        try:
            read_adapter_config(path, self.max_lora_rank)
        except InvalidRequestError as e:
            raise OpenAIError(str(e), param="lora_path", code="invalid_value") from None
        return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest) -> None:
        self.by_name[lora.lora_name] = lora

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def remove(self, name: str) -> LoRARequest:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise OpenAIError(
                f"The lora adapter '{name}' cannot be found.",
                404,
                param="lora_name",
                code="model_not_found",
            )
        return lora


async def load_into_engine(ctx: ServerContext, lora: LoRARequest) -> None:
    """Read the adapter in the engine now (one engine), so that a bad one fails here."""
    if ctx.engine.config.executor.data_parallel_size == 1:
        await ctx.engine.add_lora(lora)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    lora_name: str
    lora_int_id: int | None = None


#: Mounted only with server.allow_runtime_lora_updating.
router = APIRouter()


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses=error_responses(400, 401, 500),
)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """Add a LoRA adapter (a PEFT folder the server can read) under a model name."""
    ctx = ServerContext.of(raw)
    lora = ctx.loras.make(body.lora_name, body.lora_path)
    await load_into_engine(ctx, lora)
    ctx.loras.add(lora)
    log.info("LoRA adapter %r loaded from %s", lora.lora_name, lora.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses=error_responses(400, 401, 404, 500),
)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """Remove a model name's adapter; requests already running with it finish with it."""
    ctx = ServerContext.of(raw)
    lora = ctx.loras.remove(body.lora_name)
    if ctx.engine.config.executor.data_parallel_size == 1:
        try:
            await ctx.engine.remove_lora(lora.lora_int_id)
        except InvalidRequestError as e:  # requests in flight use it: dropped later (LRU)
            log.info("LoRA adapter %r stays loaded until its requests end: %s", lora.lora_name, e)
    log.info("LoRA adapter %r unloaded", lora.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
