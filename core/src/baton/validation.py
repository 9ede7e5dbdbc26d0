"""Is this request valid for this model? The one check every boundary runs.

The frontend (LLM, AsyncLLM), the HTTP server and the engine core (which may
be sent EngineCoreRequests by a client without a frontend) all call
``check_request``, so a request is refused at the same boundaries, with the
same message, wherever it enters. SamplingParams checks what needs no model
(types, ranges) itself; this module adds what depends on the model (context
length, vocabulary) and on the request's own fields (priority, user, the
scheduling metadata).

Every error is an InvalidRequestError whose ``param`` names the request field
("prompt", "max_tokens", "top_k", ...), and whose message names the bad value
and the fix.

``checked_request`` runs the check and returns a ``CheckedRequest``: a server
that checks a request itself (to answer 400 naming its own param) hands that to
``AsyncLLM.generate``, which then does not check it again.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from baton.errors import ContextLengthError, InvalidRequestError
from baton.protocol import ModelInfo
from baton.sampling_params import MAX_LOGPROBS, SamplingParams, show_value
from baton.scheduling_info import (
    MAX_DEADLINE_S,
    MAX_SLO_MS,
    MAX_TAG_KEY_CHARS,
    MAX_TAG_VALUE_CHARS,
    MAX_TAGS,
    MAX_TENANT_CHARS,
    SchedulingInfo,
    as_scheduling_info,
    check_priority,
)

# public at this path (docs/stability.md); defined with the other bounds in baton.scheduling_info
from baton.scheduling_info import PRIORITY_MAX as PRIORITY_MAX
from baton.scheduling_info import PRIORITY_MIN as PRIORITY_MIN

if TYPE_CHECKING:
    from baton.protocol import EngineCoreRequest


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    info: ModelInfo,
    *,
    priority: int = 0,
    user: str | None = None,
    cache_salt: str | None = None,
    scheduling: SchedulingInfo | None = None,
) -> None:
    """Raise InvalidRequestError unless the request can run on the model ``info`` describes.

    ``scheduling``, when given, must carry the same priority as ``priority`` (the
    frontends merge the two with ``baton.scheduling_info.as_scheduling_info``).
    """
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling_params must be a SamplingParams, got {type(params).__name__}",
            param="sampling_params",
        )
    params.validate()  # a struct may have been changed since it was built
    check_prompt_token_ids(prompt_token_ids, info.vocab_size)
    check_context_length(len(prompt_token_ids), params.max_tokens, info.max_model_len)
    check_params_for_model(params, info)
    if scheduling is not None:  # first: a bad scheduling.priority is reported as that field
        check_scheduling(scheduling)
    check_priority(priority)
    for name, value in (("user", user), ("cache_salt", cache_salt)):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(
                f"{name} must be a string or None, got {show_value(value)}", param=name
            )
    if scheduling is not None and scheduling.priority != priority:
        raise InvalidRequestError(
            f"priority={show_value(priority)} and scheduling.priority="
            f"{show_value(scheduling.priority)} disagree: give the priority once",
            param="priority",
        )


class CheckedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt and its parameters that ``check_request`` accepted for the model ``info``.

    Built by ``checked_request``; ``AsyncLLM.generate`` takes it as its prompt and does not
    check it again (unless its engine's model differs from ``info``). The engine core still
    checks what it receives.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    #: The request's scheduling metadata, the priority merged in.
    scheduling: SchedulingInfo
    #: The model the request was checked against.
    info: ModelInfo
    #: The prompt's text, when there is one (outputs echo it).
    prompt: str | None = None
    user: str | None = None
    cache_salt: str | None = None


def checked_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    info: ModelInfo,
    *,
    prompt: str | None = None,
    priority: int = 0,
    user: str | None = None,
    cache_salt: str | None = None,
    scheduling: SchedulingInfo | Mapping[str, Any] | None = None,
) -> CheckedRequest:
    """``check_request`` (``scheduling`` and ``priority`` merged first, as the frontends do),
    and what it accepted as a ``CheckedRequest``."""
    merged = as_scheduling_info(scheduling, priority)
    check_request(
        prompt_token_ids,
        params,
        info,
        priority=merged.priority,
        user=user,
        cache_salt=cache_salt,
        scheduling=merged,
    )
    return CheckedRequest(
        prompt_token_ids=list(prompt_token_ids),
        params=params,
        scheduling=merged,
        info=info,
        prompt=prompt,
        user=user,
        cache_salt=cache_salt,
    )


def check_engine_request(request: EngineCoreRequest, info: ModelInfo) -> None:
    """``check_request`` on a request as the engine core receives it (bad_words tokenized:
    the engine has no tokenizer)."""
    params = request.sampling_params
    if (
        isinstance(params, SamplingParams)
        and params.bad_words
        and params.bad_words_token_ids is None
    ):
        raise InvalidRequestError(
            "SamplingParams.bad_words reached the engine untokenized: set bad_words_token_ids "
            "(InputProcessor.process does it from bad_words)",
            param="bad_words",
        )
    check_request(
        request.prompt_token_ids,
        request.sampling_params,
        info,
        priority=request.priority,
        user=request.user,
        cache_salt=request.cache_salt,
        scheduling=request.scheduling,
    )


def check_prompt_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """A list of ints, each in [0, vocab_size) (its length: check_context_length)."""
    if not isinstance(ids, list | tuple):
        raise InvalidRequestError(
            f"prompt token ids must be a list of ints, got {type(ids).__name__}", param="prompt"
        )
    if not ids:
        return  # check_context_length refuses an empty prompt
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise InvalidRequestError(
                f"prompt token ids must be ints; item {i} is {show_value(t)} ({type(t).__name__})",
                param="prompt",
            )
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidRequestError(
            f"prompt token id {show_value(bad)} at position {ids.index(bad)} is outside the "
            f"vocabulary [0, {vocab_size}): give ids the model's tokenizer produces",
            param="prompt",
        )


def check_context_length(
    prompt_len: int, max_tokens: int | None, max_model_len: int | None
) -> None:
    """The one boundary: 1 <= prompt, prompt + max_tokens (at least one token) <= model.max_model_len.

    Every check of a prompt's length runs this (the frontend, the HTTP server, the engine core,
    the scheduler's admission); ``max_tokens=None`` checks the prompt alone, ``max_model_len=None``
    only that it is not empty.
    """
    if prompt_len < 1:
        raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
    if max_model_len is None or prompt_len + max(max_tokens or 1, 1) <= max_model_len:
        return
    if prompt_len >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens but model.max_model_len is {max_model_len} "
            f"(prompt + output), so it can be at most {max_model_len - 1} tokens: shorten the "
            "prompt or raise model.max_model_len",
            param="prompt",
        )
    room = max_model_len - prompt_len
    raise ContextLengthError(
        f"SamplingParams.max_tokens={max_tokens} is too large: the prompt has {prompt_len} "
        f"tokens and model.max_model_len is {max_model_len} (prompt + output): lower max_tokens "
        f"to at most {room}",
        param="max_tokens",
    )


def check_params_for_model(params: SamplingParams, info: ModelInfo) -> None:
    """The sampling fields bounded by the model's vocabulary."""
    vocab = info.vocab_size
    if params.top_k > vocab:
        raise InvalidRequestError(
            f"SamplingParams.top_k must be at most the vocabulary size ({vocab}), or 0 / -1 to "
            f"disable, got {show_value(params.top_k)}",
            param="top_k",
        )
    bad = next((t for t in params.stop_token_ids or () if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"SamplingParams.stop_token_ids must hold token ids in [0, {vocab}) (the "
            f"vocabulary), got {show_value(bad)}",
            param="stop_token_ids",
        )
    limit = min(MAX_LOGPROBS, vocab)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise InvalidRequestError(
                f"SamplingParams.{name} must be in [0, {limit}], got {value}", param=name
            )
    for name, ids in (
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words", [t for w in params.bad_words_token_ids or () for t in w]),
    ):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"SamplingParams.{name} must name token ids in [0, {vocab}) (the vocabulary), "
                f"got {show_value(bad)}",
                param=name,
            )


def check_scheduling(info: Any) -> None:
    """A SchedulingInfo whose every field has its type and is within its bound.

    The error's ``param`` is ``scheduling.<field>``.
    """
    if not isinstance(info, SchedulingInfo):
        raise InvalidRequestError(
            f"scheduling must be a SchedulingInfo, got {type(info).__name__}", param="scheduling"
        )
    try:
        check_priority(info.priority)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"scheduling.{e}", param="scheduling.priority") from None
    deadline = info.deadline
    if deadline is not None:
        if not isinstance(deadline, numbers.Real) or isinstance(deadline, bool):
            raise InvalidRequestError(
                f"scheduling.deadline must be a number of seconds after arrival, got "
                f"{show_value(deadline)} ({type(deadline).__name__})",
                param="scheduling.deadline",
            )
        if not (math.isfinite(deadline) and 0 < deadline <= MAX_DEADLINE_S):
            raise InvalidRequestError(
                f"scheduling.deadline must be in (0, {MAX_DEADLINE_S:.0f}] seconds after the "
                f"request's arrival, got {show_value(deadline)}",
                param="scheduling.deadline",
            )
    _check_string(info.tenant, "scheduling.tenant", MAX_TENANT_CHARS, optional=True)
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        _check_slo(getattr(info, name), f"scheduling.{name}")
    tags = info.tags
    if not isinstance(tags, dict):
        raise InvalidRequestError(
            f"scheduling.tags must be a mapping of strings to strings, got {type(tags).__name__}",
            param="scheduling.tags",
        )
    if len(tags) > MAX_TAGS:
        raise InvalidRequestError(
            f"scheduling.tags has {len(tags)} entries, more than the {MAX_TAGS} allowed: drop some",
            param="scheduling.tags",
        )
    for key, value in tags.items():
        _check_string(key, "scheduling.tags", MAX_TAG_KEY_CHARS, what="a key of scheduling.tags")
        _check_string(
            value,
            "scheduling.tags",
            MAX_TAG_VALUE_CHARS,
            what=f"scheduling.tags[{show_value(key, 40)}]",
            min_chars=0,
        )


def _check_slo(value: Any, param: str) -> None:
    """An SLO target: None, or milliseconds in (0, MAX_SLO_MS]."""
    if value is None:
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidRequestError(
            f"{param} must be a number of milliseconds, got {show_value(value)} "
            f"({type(value).__name__})",
            param=param,
        )
    if not (math.isfinite(value) and 0 < value <= MAX_SLO_MS):
        raise InvalidRequestError(
            f"{param} must be in (0, {MAX_SLO_MS:.0f}] milliseconds, got {show_value(value)}",
            param=param,
        )


def _check_string(
    value: Any,
    param: str,
    max_chars: int,
    *,
    what: str | None = None,
    optional: bool = False,
    min_chars: int = 1,
) -> None:
    """A str of ``min_chars`` to ``max_chars`` characters (or None when ``optional``)."""
    if value is None and optional:
        return
    name = what or param
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{name} must be a string, got {show_value(value)} ({type(value).__name__})",
            param=param,
        )
    if not min_chars <= len(value) <= max_chars:
        raise InvalidRequestError(
            f"{name} must have {min_chars} to {max_chars} characters, got {len(value)}: "
            f"{show_value(value, 40)}",
            param=param,
        )


def check_text(text: str, what: str = "the prompt", param: str = "prompt") -> None:
    """Text the tokenizer can encode: valid UTF-8 (no lone surrogates such as ``"\\udc80"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{what} is not valid UTF-8 text: {text[e.start : e.end]!r} at position {e.start} is a "
            "lone surrogate; decode the bytes it came from with errors='replace', or remove it",
            param=param,
        ) from None


def as_token_ids(value: Any, param: str = "prompt") -> list[int]:
    """A token-id prompt as a list of ints; bools, floats, bytes and others are refused."""
    if isinstance(value, bytes | bytearray | memoryview):
        raise InvalidRequestError(
            f"a prompt of type {type(value).__name__} is neither text nor token ids: decode it "
            "(prompt.decode('utf-8')) or pass a list of ints",
            param=param,
        )
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise InvalidRequestError(
            f"prompt token ids must be a list of ints, got {type(value).__name__}", param=param
        )
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise InvalidRequestError(
                f"prompt token ids must be ints; item {i} is {show_value(t)} ({type(t).__name__})",
                param=param,
            )
        out.append(int(t))
    return out
