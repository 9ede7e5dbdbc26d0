"""Request and response models shaped like OpenAI's (plus vLLM's extra sampling fields).

Field constraints live here, so that a bad value is a 400 naming the parameter
before anything reaches the engine. Unknown request fields are accepted and
ignored with a warning, as OpenAI-compatible servers do (clients send fields
that a server may not know).

Validation runs on the event loop, so every list and object a request may make
long is bounded (the MAX_* constants: generous for any client): pydantic stops
at the bound, so a request of a million items costs what one at the bound does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, model_validator
from pydantic_core import PydanticCustomError

from baton.sampling_params import MAX_INT32, MAX_LOGPROBS, MAX_N, MAX_SEED
from baton.validation import PRIORITY_MAX, PRIORITY_MIN

#: Prompts in one completion request (a batch).
MAX_PROMPTS = 1024
#: Token ids in one prompt: more than any model's context. The served model's own
#: model.max_model_len is checked by the prompt's length before its ids are looked at.
MAX_PROMPT_TOKENS = 2**20
#: Messages in one chat request (validating 4096 takes ~5 ms).
MAX_MESSAGES = 4096
#: Fields of a request, known and unknown (unknown ones are ignored, but each costs).
MAX_FIELDS = 256
#: Fields of one chat message (role, content, name, tool_calls, ...): 4096 messages of 16
#: fields take ~30 ms to validate.
MAX_MESSAGE_FIELDS = 16
#: Items of any other list or object: stop strings, stop_token_ids, guided_choice, tools,
#: content parts, logit_bias, chat_template_kwargs.
MAX_ITEMS = 1024

#: A token id as a request may carry one (the vocabulary bound is checked against the model).
TokenId = Annotated[int, Field(ge=0, lt=MAX_INT32)]
Bounded = Field(max_length=MAX_ITEMS)


def _at_most_fields(data: Any, limit: int, what: str) -> Any:
    if isinstance(data, dict) and len(data) > limit:
        raise PydanticCustomError(
            "too_many_fields",
            "{what} has {count} fields, more than the {limit} accepted: remove the unknown ones",
            {"what": what, "count": len(data), "limit": limit},
        )
    return data


#: Request models take JSON types as the schema states them: no "0.5" for a number, no 1 for
#: true, no 2.0 or true for an integer (OpenAI's API refuses those too; lax coercion would let
#: a request the schema calls invalid through, and hide a client's bug).
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class _Model(BaseModel):
    # no NaN or infinity in any float field (JSON has neither, but Python's parsers accept them)
    model_config = STRICT | ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        return _at_most_fields(data, MAX_FIELDS, "the request")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    """Send a last chunk with the usage of the whole request (choices empty)."""
    continuous_usage_stats: bool = False
    """vLLM's extension: usage in every chunk."""


class JsonSchemaFormat(BaseModel):
    model_config = STRICT | ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint. Its other options are refused by
    name (params.structured_spec): baton has no way to honour them."""

    model_config = STRICT | ConfigDict(extra="allow", populate_by_name=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Bounded] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplerFields(_Model):
    """The sampling fields every generation API takes (chat, completions, /v1/responses,
    /v1/messages), vLLM's extras among them."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    top_k: int | None = Field(None, ge=-1, lt=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's current structured-output field (one of its constraints)."""

    def sampler_fields(self) -> dict[str, Any]:
        """These fields' values, to build the chat request another API's request runs as."""
        return {name: getattr(self, name) for name in SamplerFields.model_fields}


class SamplingFields(SamplerFields):
    """What chat and completion requests share: sampling, stops, structured output, extras."""

    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | Annotated[list[str], Bounded] | None = None
    max_tokens: int | None = Field(None, ge=1, lt=MAX_INT32)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Bounded] | None
    ) = None
    """Token id (as a string, OpenAI's form) -> a bias in [-100, 100] added to its logit."""
    # vLLM-style extras (openai client: extra_body={...}); top_k, min_p, repetition_penalty above
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=MAX_INT32)
    stop_token_ids: Annotated[list[TokenId], Bounded] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    scheduling: Annotated[dict[str, Any], Bounded] | None = None
    """baton's extra: what the scheduler policy may read (priority, deadline in seconds after
    arrival, tenant, tags, SLO targets slo_ttft_ms / slo_tpot_ms); its fields are checked by
    baton.validation, naming scheduling.<field>."""
    allowed_token_ids: Annotated[list[TokenId], Bounded] | None = None
    """vLLM's: only these tokens may be generated."""
    bad_words: Annotated[list[str], Bounded] | None = None
    """vLLM's: words never generated (a word of several tokens: its last token is banned where
    the others were just generated)."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt token's logprob and the top k there (not with stream)."""
    kv_transfer_params: Annotated[dict[str, Any], Bounded] | None = None
    """vLLM's: what the engine's KV connector reads (``[kv_transfer]``), e.g. a producer's
    params from a prefill's response, for the consumer that decodes (docs/kv-connectors.md)."""
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Bounded] | None = None
    guided_grammar: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT | ConfigDict(extra="allow")

    role: str
    content: str | Annotated[list[dict[str, Any]], Bounded] | None = None
    name: str | None = None


def _message_fields_bounded(messages: Any) -> Any:
    """Each message's field count checked in one call per request (a validator on ChatMessage
    would cost a Python call per message, more than validating the message does)."""
    if isinstance(messages, list) and len(messages) <= MAX_MESSAGES:
        for i, m in enumerate(messages):
            _at_most_fields(m, MAX_MESSAGE_FIELDS, f"messages[{i}]")
    return messages  # a longer list is refused by max_length


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: Annotated[dict[str, Any], Bounded] | None = None
    """The arguments' JSON schema (none: any JSON object)."""
    strict: bool | None = None
    """Accepted; arguments follow the schema when tool_choice is required or names the
    function (the answer is constrained), not with auto."""


class ChatTool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class BeamSearchFields(SamplingFields):
    """vLLM's beam search extension of the chat and completion requests."""

    use_beam_search: bool = False
    """Beam search (``AsyncLLM.beam_search``) with beam_width = n: the n best beams are the
    choices; not with stream, logprobs or constraints on the output."""
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    """A beam's score is cum_logprob / seq_len ** length_penalty (use_beam_search)."""


class ChatCompletionRequest(BeamSearchFields):
    messages: Annotated[
        list[ChatMessage],
        Field(min_length=1, max_length=MAX_MESSAGES),
        BeforeValidator(_message_fields_bounded),
    ]
    max_completion_tokens: int | None = Field(None, ge=1, lt=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ChatTool], Bounded] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[str, Any], Bounded] | None = None


#: What a completion prompt may be (the schema; ``prompt_shape`` checks it).
PromptInput = (
    str
    | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    | Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
    | Annotated[
        list[Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]],
        Field(max_length=MAX_PROMPTS),
    ]
)


def prompt_shape(value: Any) -> str | list[Any]:
    """A completion prompt whose shape is one of PromptInput's, told by its first item.

    Only the lengths and the shape are checked here, on the event loop; each token id
    is checked on a preprocessing worker (AsyncLLM.tokenize, then the vocabulary
    bound). A plain union would validate a million ids once per branch it tries.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _prompt_error(f"got {type(value).__name__}")
    if not value:
        return value
    first = value[0]
    if isinstance(first, str | list):
        _at_most(value, MAX_PROMPTS, "prompts")
        kind = type(first)
        bad = next((i for i, p in enumerate(value) if type(p) is not kind), None)
        if bad is not None:
            raise _prompt_error(
                f"a list of {kind.__name__}s has item {bad} of type {type(value[bad]).__name__}"
            )
        if kind is list:
            for p in value:
                _at_most(p, MAX_PROMPT_TOKENS, "token ids")
        return value
    if isinstance(first, int) and not isinstance(first, bool):
        _at_most(value, MAX_PROMPT_TOKENS, "token ids")
        return value
    raise _prompt_error(f"a list whose first item is {type(first).__name__}")


def _at_most(items: list[Any], limit: int, what: str) -> None:
    if len(items) > limit:
        raise PydanticCustomError(
            "too_long",
            "at most {limit} {what} are accepted, got {count}",
            {"limit": limit, "what": what, "count": len(items)},
        )


def _prompt_error(got: str) -> PydanticCustomError:
    return PydanticCustomError(
        "prompt_type",
        "prompt must be a text, a list of texts, a list of token ids or a list of lists of "
        "token ids; {got}",
        {"got": got},
    )


class CompletionRequest(BeamSearchFields):
    prompt: Annotated[Any, PlainValidator(prompt_shape, json_schema_input_type=PromptInput)]
    max_tokens: int | None = Field(None, ge=0, lt=MAX_INT32)
    """0 only with echo: the prompt comes back alone (with its logprobs), as vLLM does."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


# ---------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text."""


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallItem] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: what the engine's KV connector returned, e.g. where a consumer finds this
    prefill's KV (None: nothing)."""


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class PromptLogprob(BaseModel):
    """One candidate at one prompt position (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's prompt_logprobs: per prompt position, token id (a string in JSON) -> its candidate;
#: None for the first position.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: what the engine's KV connector returned (None: nothing)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "baton"
    root: str | None = None
    #: A LoRA adapter's base model (None for the served model itself).
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
