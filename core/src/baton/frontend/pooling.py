"""A pooling request on its way from a frontend (LLM, AsyncLLM) to the engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from baton.config import ModelSection
from baton.frontend.input_processor import InputProcessor
from baton.lora.request import LoRARequest
from baton.pooling_params import (
    PoolingParams,
    check_pooling,
    default_pooling_type,
    pooling_sampling_params,
    with_defaults,
)
from baton.protocol import EngineCoreRequest
from baton.scheduling_info import SchedulingInfo


def check_pooling_prompt(
    processor: InputProcessor,
    model: ModelSection,
    prompt_token_ids: Sequence[int],
    params: PoolingParams | None,
    *,
    priority: int = 0,
    user: str | None = None,
    scheduling: SchedulingInfo | Mapping[str, Any] | None = None,
) -> tuple[PoolingParams, SchedulingInfo]:
    """The request's PoolingParams (the config's defaults filled in) and SchedulingInfo,
    after the checks every request gets (``check_request``) and the pooling ones."""
    kind = default_pooling_type(model.pooling_type, processor.info)
    full = with_defaults(params, kind, model.pooling_normalize)
    check_pooling(prompt_token_ids, full, processor.info)
    merged = processor.validate(
        prompt_token_ids,
        pooling_sampling_params(),
        priority=priority,
        user=user,
        scheduling=scheduling,
    )
    return full, merged


def pooling_engine_request(
    processor: InputProcessor,
    request_id: str,
    prompt_token_ids: list[int],
    params: PoolingParams,
    *,
    scheduling: SchedulingInfo,
    arrival_time: float,
    user: str | None = None,
    lora_request: LoRARequest | None = None,
) -> EngineCoreRequest:
    """The EngineCoreRequest of a checked pooling prompt."""
    req = processor.process(
        request_id,
        prompt_token_ids,
        pooling_sampling_params(),
        scheduling=scheduling,
        arrival_time=arrival_time,
        user=user,
        lora_request=lora_request,
    )
    return msgspec.structs.replace(req, pooling_params=params)
