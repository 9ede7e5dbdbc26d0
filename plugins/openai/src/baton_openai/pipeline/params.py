"""From an OpenAI request to baton's SamplingParams and SchedulingInfo: defaults, structured
output, the request check.

Everything here raises OpenAIError naming the request parameter (as the client
spelled it), so the 400 points at what to fix. The checks themselves are
baton's (SamplingParams and baton.validation), the same the engine runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from baton.errors import InvalidRequestError, StructuredOutputError
from baton.protocol import ModelInfo
from baton.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputSpec
from baton.scheduling_info import SchedulingInfo, as_scheduling_info
from baton.validation import CheckedRequest, checked_request
from baton_openai.http.errors import OpenAIError, from_baton_error
from baton_openai.protocol.openai import SamplingFields


@dataclass(frozen=True)
class BuiltParams:
    params: SamplingParams
    #: The request field that carried the structured-output spec (for error messages), if any.
    structured_param: str | None
    #: SamplingParams field -> the request's name for it (max_tokens may be max_completion_tokens).
    param_names: dict[str, str]
    #: The request field holding the prompt ("messages" or "prompt").
    prompt_param: str = "prompt"
    #: What the scheduler policy reads: the body's ``scheduling`` with its ``priority`` merged in.
    scheduling: SchedulingInfo = field(default_factory=SchedulingInfo)
    #: The prompt and its parameters as baton's check accepted them: what AsyncLLM.generate
    #: takes without checking them again.
    checked: CheckedRequest | None = None


def logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias) with int keys."""
    if not req.logit_bias:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise OpenAIError(
                f"logit_bias keys must be token ids written as decimal strings, got {key!r}",
                param="logit_bias",
                code="invalid_value",
            )
        out[int(key)] = bias
    return out


def kv_transfer_args(req: SamplingFields) -> dict[str, object] | None:
    """``SamplingParams.extra_args`` carrying the request's ``kv_transfer_params`` (vLLM's route
    to the KV connector); one engine request gets them, so ``n`` must be 1."""
    if req.kv_transfer_params is None:
        return None
    if req.n != 1:
        raise OpenAIError(
            f"kv_transfer_params go with one generation, but n = {req.n}: send n = 1",
            param="n",
            code="invalid_value",
        )
    return {"kv_transfer_params": req.kv_transfer_params}


def _structured_outputs(req: SamplingFields) -> dict[str, object] | None:
    """vLLM's structured_outputs as StructuredOutputSpec fields; its options baton cannot
    honour are refused by name."""
    so = req.structured_outputs
    if so is None:
        return None
    extra = sorted(so.model_extra or ())
    if extra:
        raise OpenAIError(
            f"structured_outputs.{extra[0]} is not supported by baton: give one of json, regex, "
            "choice, grammar, json_object",
            param=f"structured_outputs.{extra[0]}",
            code="unsupported_parameter",
        )
    fields: dict[str, object] = {
        k: v
        for k, v in (
            ("json", so.json_schema),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
        )
        if v is not None
    }
    if so.json_object:
        fields["json_object"] = True
    return fields


def structured_spec(req: SamplingFields) -> tuple[StructuredOutputSpec | None, str | None]:
    """The one structured-output spec of a request (structured_outputs, response_format or a
    guided_* field)."""
    specs: list[tuple[str, dict[str, object]]] = []
    fields = _structured_outputs(req)
    if fields is not None:
        specs.append(("structured_outputs", fields))
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise OpenAIError(
                "response_format of type json_schema needs json_schema.schema (a JSON schema object)",
                param="response_format",
                code="invalid_value",
            )
        specs.append(("response_format", {"json": rf.json_schema.json_schema}))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            specs.append((name, {key: value}))
    if not specs:
        return None, None
    if len(specs) > 1:
        names = ", ".join(n for n, _ in specs)
        raise OpenAIError(
            f"set only one structured-output constraint, got {names}",
            param=specs[1][0],
            code="invalid_value",
        )
    param, fields = specs[0]
    try:
        return StructuredOutputSpec(**fields), param  # type: ignore[arg-type]
    except StructuredOutputError as e:
        raise OpenAIError(str(e), param=param, code="invalid_value") from None


def build_params(
    req: SamplingFields,
    *,
    prompt_token_ids: Sequence[int],
    info: ModelInfo,
    max_tokens: int | None,
    max_tokens_param: str,
    prompt_param: str,
    logprobs: int | None,
    logprobs_param: str = "logprobs",
    tool_spec: StructuredOutputSpec | None = None,
    prompt_logprobs: int | None = None,
    prompt_logprobs_param: str = "prompt_logprobs",
) -> BuiltParams:
    """SamplingParams for one prompt, checked against the model (baton.validation.check_request).

    ``max_tokens=None`` takes the room the prompt leaves in the context. Output streams as deltas.
    ``tool_spec``: the constraint of tool_choice required / a named function (tools.py).
    ``prompt_logprobs``: the request's, or what echo with logprobs needs (completions).
    """
    names = {
        "max_tokens": max_tokens_param,
        "logprobs": logprobs_param,
        "prompt_logprobs": prompt_logprobs_param,
        "prompt": prompt_param,
        "prompt_token_ids": prompt_param,
    }
    spec, structured_param = structured_spec(req)
    if tool_spec is not None:
        if spec is not None:
            raise OpenAIError(
                f"tool_choice required or a named function constrains the answer to a call, so "
                f"it cannot be combined with {structured_param}",
                param=structured_param,
                code="invalid_value",
            )
        spec, structured_param = tool_spec, "tools"
    room = max(info.max_model_len - len(prompt_token_ids), 1)  # too long a prompt: check says so
    try:
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            max_tokens=room if max_tokens is None else max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop or None,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=spec,
            output_kind=RequestOutputKind.DELTA,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias(req),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            extra_args=kv_transfer_args(req),
        )
        checked = checked_request(
            prompt_token_ids,
            params,
            info,
            user=req.user,
            scheduling=as_scheduling_info(req.scheduling, req.priority),
        )
    except InvalidRequestError as e:
        raise from_baton_error(e, names) from None
    return BuiltParams(params, structured_param, names, prompt_param, checked.scheduling, checked)
