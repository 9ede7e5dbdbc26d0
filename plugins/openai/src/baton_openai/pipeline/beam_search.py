"""use_beam_search (vLLM's extension) on /v1/completions and /v1/chat/completions: the
request's parameters, the searches on the engine, the choices' finish reasons and usage."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from baton.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from baton.errors import BatonError
from baton_openai.http.errors import OpenAIError, from_baton_error
from baton_openai.http.streaming import cancel_on_disconnect
from baton_openai.pipeline.context import ServerContext
from baton_openai.protocol.openai import BeamSearchFields, Usage

#: max_tokens of a beam search that names none (OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16


def beam_search_params(
    req: BeamSearchFields, max_tokens: int | None, also_refused: Mapping[str, bool]
) -> BeamSearchParams:
    """The search's parameters; a field beam search does not honour is refused, named."""
    refused = {
        "stream": req.stream,
        "prompt_logprobs": req.prompt_logprobs is not None,
        "response_format": req.response_format is not None,
        "structured_outputs": req.structured_outputs is not None,
        "guided_json": req.guided_json is not None,
        "guided_regex": req.guided_regex is not None,
        "guided_choice": req.guided_choice is not None,
        "guided_grammar": req.guided_grammar is not None,
        "logit_bias": bool(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids is not None,
        "bad_words": bool(req.bad_words),
        "kv_transfer_params": req.kv_transfer_params is not None,
        **also_refused,
    }
    for param, given in refused.items():
        if given:
            raise OpenAIError(
                f"{param} is not supported with use_beam_search: leave one of them out",
                param=param,
                code="unsupported_parameter",
            )
    return BeamSearchParams(
        beam_width=req.n,
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        ignore_eos=req.ignore_eos,
        temperature=req.temperature or 0.0,
        length_penalty=req.length_penalty,
    )


async def run_beam_searches(
    ctx: ServerContext,
    raw: Request,
    req: BeamSearchFields,
    ids_list: list[list[int]],
    params: BeamSearchParams,
) -> list[BeamSearchOutput] | Any:
    """One search per prompt, concurrently; DISCONNECTED when the client left first."""
    lora = ctx.lora_for(req)
    searches = asyncio.gather(
        *(
            ctx.engine.beam_search({"prompt_token_ids": ids}, params, lora_request=lora)
            for ids in ids_list
        )
    )
    try:
        return await cancel_on_disconnect(raw, searches)
    except BatonError as e:
        raise from_baton_error(e) from None


def finish_reason(
    seq: BeamSearchSequence, prompt_len: int, ctx: ServerContext, ignore_eos: bool
) -> str:
    """``stop`` for a beam that ended with EOS, else ``length`` (vLLM's)."""
    eos = ctx.engine.get_tokenizer().eos_token_id
    stopped = len(seq.tokens) > prompt_len and seq.tokens[-1] == eos and not ignore_eos
    return "stop" if stopped else "length"


def beam_usage(ids_list: list[list[int]], outs: list[BeamSearchOutput]) -> Usage:
    """The prompts' tokens, and the tokens of every returned beam."""
    prompt = sum(len(ids) for ids in ids_list)
    generated = sum(
        len(s.tokens) - len(ids) for ids, o in zip(ids_list, outs, strict=True) for s in o.sequences
    )
    return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)
