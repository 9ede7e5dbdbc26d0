"""A pooling request on its way from a frontend (LLM, AsyncLLM) to the engine."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from baton.config import ModelSection
from baton.frontend.prompts import InputProcessor
from baton.frontend.request_meta import RequestMeta
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
    meta: RequestMeta,
) -> tuple[PoolingParams, SchedulingInfo]:
    """The request's PoolingParams (the config's defaults filled in) and SchedulingInfo,
    after the checks every request gets (``check_request``) and the pooling ones."""
    kind = default_pooling_type(model.pooling_type, processor.info)
    full = with_defaults(params, kind, model.pooling_normalize)
    check_pooling(prompt_token_ids, full, processor.info)
    merged = processor.validate(
        prompt_token_ids,
        pooling_sampling_params(),
        priority=meta.priority,
        user=meta.user,
        scheduling=meta.scheduling,
    )
    return full, merged


def pooling_engine_request(
    processor: InputProcessor,
    request_id: str,
    prompt_token_ids: list[int],
    params: PoolingParams,
    scheduling: SchedulingInfo,
    arrival_time: float,
    meta: RequestMeta,
) -> EngineCoreRequest:
    """The EngineCoreRequest of a checked pooling prompt (``scheduling``: what
    ``check_pooling_prompt`` returned)."""
    req = processor.process(
        request_id,
        prompt_token_ids,
        pooling_sampling_params(),
        scheduling=scheduling,
        arrival_time=arrival_time,
        user=meta.user,
        lora_request=meta.lora_request,
    )
    return msgspec.structs.replace(req, pooling_params=params)
