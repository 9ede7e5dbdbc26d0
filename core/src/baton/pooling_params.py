"""PoolingParams: how to turn a prompt's hidden states into one vector (vLLM's names).

A pooling request (``LLM.embed``, ``AsyncLLM.encode``, ``/v1/embeddings``) runs its
prompt through the same scheduler and model runner steps as generation; instead
of sampling after its last prompt token, the runner pools the final hidden
states (after the model's final norm) and the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import msgspec

from baton.errors import InvalidRequestError
from baton.sampling_params import RequestOutputKind, SamplingParams, show_value

if TYPE_CHECKING:  # baton.protocol imports this module
    from baton.config import ModelSection
    from baton.protocol import EngineCoreRequest, ModelInfo

#: last: the last prompt token's hidden state (causal LMs); mean: the mean over every
#: prompt token; cls: the first token's (BERT-style encoders).
POOLING_TYPES = ("last", "mean", "cls")
PoolingType = Literal["last", "mean", "cls"]


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """How to pool one request. None fields take the config's ``model.pooling_type`` /
    ``model.pooling_normalize`` (``with_defaults``).

    ``dimensions`` keeps the first n values (before normalising): only for models trained
    for it (Matryoshka; their config.json says ``matryoshka_dimensions`` or ``is_matryoshka``).
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """InvalidRequestError naming the field, the value and the fix."""
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"PoolingParams.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {show_value(self.pooling_type)}",
                param="pooling_type",
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(
                f"PoolingParams.normalize must be true or false, got {show_value(self.normalize)}",
                param="normalize",
            )
        d = self.dimensions
        if d is not None and (type(d) is not int or d < 1):
            raise InvalidRequestError(
                f"PoolingParams.dimensions must be a positive integer, got {show_value(d)}",
                param="dimensions",
            )

    @property
    def needs_all_tokens(self) -> bool:
        """Whether every prompt token's hidden state counts (so no prefix-cache hit may skip one)."""
        return self.pooling_type != "last"


def with_defaults(
    params: PoolingParams | None, pooling_type: str, normalize: bool
) -> PoolingParams:
    """``params`` with its None fields set: ``pooling_type`` (``default_pooling_type``) and
    ``normalize`` (``model.pooling_normalize``)."""
    p = params if params is not None else PoolingParams()
    if not isinstance(p, PoolingParams):
        raise InvalidRequestError(
            f"pooling_params must be a PoolingParams, got {type(p).__name__}",
            param="pooling_params",
        )
    return msgspec.structs.replace(
        p,
        pooling_type=p.pooling_type if p.pooling_type is not None else pooling_type,
        normalize=p.normalize if p.normalize is not None else normalize,
    )


def default_pooling_type(configured: str, info: ModelInfo) -> str:
    """``model.pooling_type``, its ``"auto"`` resolved to the model's own (``ModelInfo.pooling_type``)."""
    return info.pooling_type if configured == "auto" else configured


def pooling_sampling_params() -> SamplingParams:
    """The SamplingParams a pooling request carries through the engine: it never samples,
    it only needs room for its prompt (``max_tokens=1``: a prompt of up to
    ``model.max_model_len - 1`` tokens)."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def check_pooling(prompt_token_ids: Sequence[int], params: PoolingParams, info: ModelInfo) -> None:
    """What a pooling request needs beyond ``check_request``: ``dimensions`` only on a
    Matryoshka model, within its listed sizes and its hidden size."""
    params.validate()
    d = params.dimensions
    if d is None:
        return
    allowed = info.matryoshka_dimensions
    if allowed is None:
        raise InvalidRequestError(
            f"dimensions={d}: the model {info.architecture} was not trained for shortened "
            "embeddings (its config.json has no matryoshka_dimensions / is_matryoshka): "
            "leave dimensions unset",
            param="dimensions",
        )
    if allowed and d not in allowed:
        raise InvalidRequestError(
            f"dimensions={d} is not one the model supports: choose one of {allowed}",
            param="dimensions",
        )
    if info.hidden_size and d > info.hidden_size:
        raise InvalidRequestError(
            f"dimensions={d} exceeds the model's hidden size {info.hidden_size}: choose at most that",
            param="dimensions",
        )


def pooled_request(
    request: EngineCoreRequest, model: ModelSection, info: ModelInfo
) -> EngineCoreRequest:
    """A pooling request as the engine core admits it: ``check_pooling``, its PoolingParams'
    None fields set from ``model`` (a client may send requests without a frontend)."""
    assert request.pooling_params is not None
    params = with_defaults(
        request.pooling_params,
        default_pooling_type(model.pooling_type, info),
        model.pooling_normalize,
    )
    check_pooling(request.prompt_token_ids, params, info)
    return msgspec.structs.replace(request, pooling_params=params)


def check_generation(info: ModelInfo) -> None:
    """InvalidRequestError when the model cannot generate (a base model without an LM head)."""
    if info.runner_type == "pooling":
        raise InvalidRequestError(
            f"the model {info.architecture} has no language-model head: it computes embeddings "
            "(LLM.embed, AsyncLLM.encode, /v1/embeddings) and cannot generate text; serve a "
            "causal LM (a *ForCausalLM checkpoint) to generate",
            param="model",
        )
