"""POST /tokenize and /detokenize, shaped as vLLM's.

/tokenize takes a text (``prompt``) or a conversation (``messages``, rendered
with the chat template exactly as /v1/chat/completions renders it, tools
included) and answers ``{"count", "max_model_len", "tokens"}``, plus
``token_strs`` with ``return_token_strs``. /detokenize takes token ids and
answers ``{"prompt"}``. Both run on the preprocessing workers, within
``server.preprocess_timeout``, and refuse a bad field with a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, BeforeValidator, Field, model_validator

from baton.errors import InvalidRequestError
from baton_openai.endpoints.chat import client_chat_template, template_in_use, template_messages
from baton_openai.http.errors import OpenAIError, from_baton_error
from baton_openai.http.json_body import PiecewiseJSONRoute
from baton_openai.http.openapi import error_responses
from baton_openai.pipeline.context import ServerContext
from baton_openai.pipeline.tools import plan_tools, template_renders_tools, with_tool_instructions
from baton_openai.protocol.openai import (
    MAX_MESSAGES,
    MAX_PROMPT_TOKENS,
    Bounded,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    NamedToolChoice,
    TokenId,
    _message_fields_bounded,
    _Model,
)

router = APIRouter(route_class=PiecewiseJSONRoute)
#: what the two routes may answer besides 200 (no 429: they never queue for the engine)
TOKENIZER_ERRORS = (400, 401, 404, 408, 413, 500, 503)


class TokenizeRequest(_Model):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: (
        Annotated[
            list[ChatMessage],
            Field(min_length=1, max_length=MAX_MESSAGES),
            BeforeValidator(_message_fields_bounded),
        ]
        | None
    ) = None
    #: None: True for a prompt (as /v1/completions tokenizes it), False for messages (the
    #: template writes the special tokens itself)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[str, Any], Bounded] | None = None
    tools: Annotated[list[ChatTool], Bounded] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (a text) or messages (a conversation)")
        if self.prompt is not None and self.add_special_tokens is None:
            self.add_special_tokens = True
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post(
    "/tokenize", response_model_exclude_none=True, responses=error_responses(*TOKENIZER_ERRORS)
)
async def tokenize(req: TokenizeRequest, raw: Request) -> TokenizeResponse:
    ctx = ServerContext.of(raw)
    ctx.check_request(req)
    engine = ctx.engine
    pre = ctx.preprocess
    if req.messages is not None:
        ids = await chat_prompt_ids(req, ctx)
        if req.add_special_tokens:  # vLLM's: the tokenizer's own (BOS) before the rendered chat
            ids = engine.get_tokenizer().build_inputs_with_special_tokens(ids)
    else:
        text = req.prompt
        assert text is not None and req.add_special_tokens is not None
        special = req.add_special_tokens
        try:
            ids = await pre.run(
                lambda: engine.tokenize(text, add_special_tokens=special),
                deadline=pre.deadline(),
                what="tokenizing the prompt",
                param="prompt",
            )
        except InvalidRequestError as e:
            raise from_baton_error(e) from None
    strs = None
    if req.return_token_strs:
        strs = await pre.run(
            lambda: [str(t) for t in engine.get_tokenizer().convert_ids_to_tokens(ids)],
            deadline=pre.deadline(),
            what="naming the tokens",
            param="return_token_strs",
        )
    return TokenizeResponse(
        count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
    )


async def chat_prompt_ids(
    req: TokenizeRequest | ChatCompletionRequest, ctx: ServerContext
) -> list[int]:
    """The conversation's token ids, as /v1/chat/completions renders it (tools included);
    also what /v1/messages/count_tokens counts."""
    assert req.messages is not None
    messages = req.messages
    client_template, template_kwargs = client_chat_template(req)  # type: ignore[arg-type]
    plan = plan_tools(req)  # type: ignore[arg-type]
    build = lambda: template_messages(messages)  # noqa: E731
    if plan is not None:
        if template_renders_tools(template_in_use(ctx, client_template)):
            template_kwargs = {**template_kwargs, "tools": plan.template_tools()}
        else:
            build = lambda: with_tool_instructions(  # noqa: E731
                template_messages(messages), plan, ctx.tool_parser
            )
    try:
        return await ctx.preprocess.chat_ids(
            build,
            req.add_generation_prompt,
            template_kwargs,
            client_template,
            deadline=ctx.preprocess.deadline(),
        )
    except InvalidRequestError as e:
        err = from_baton_error(e)
        err.param = err.param or "messages"
        raise err from None


@router.post("/detokenize", responses=error_responses(*TOKENIZER_ERRORS))
async def detokenize(req: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    ctx = ServerContext.of(raw)
    ctx.check_request(req)
    engine = ctx.engine
    tokens = req.tokens
    vocab = engine.info.vocab_size
    bad = next((i for i, t in enumerate(tokens) if t >= vocab), None)
    if bad is not None:
        raise OpenAIError(
            f"tokens[{bad}] = {tokens[bad]} is outside the model's vocabulary [0, {vocab}): "
            "give ids the model's tokenizer produces",
            param="tokens",
            code="invalid_value",
        )
    pre = ctx.preprocess
    text = await pre.run(
        lambda: engine.get_tokenizer().decode(tokens),
        deadline=pre.deadline(),
        what="detokenizing the tokens",
        param="tokens",
    )
    return DetokenizeResponse(prompt=text)
