"""baton's per-position logprobs ({token_id: Logprob}) in OpenAI's chat and completion shapes,
and prompt logprobs in vLLM's (``prompt_logprobs``) and in echo's (completions)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from baton.outputs import Logprob, PromptLogprobs, SampleLogprobs
from baton_openai.protocol.openai import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from baton_openai.protocol.openai import PromptLogprobs as PromptLogprobsField


def _top(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely candidates of one position, by rank (the sampled token may be among them)."""
    ranked = sorted(
        ((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k),
        key=lambda item: item[1].rank or 0,
    )
    return ranked[:k]


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def chat_logprobs(token_ids: Sequence[int], logprobs: SampleLogprobs, k: int) -> ChatLogprobs:
    content = []
    for tid, position in zip(token_ids, logprobs, strict=False):
        sampled = position[tid]
        text = _text(sampled)
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=sampled.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=_text(lp), logprob=lp.logprob, bytes=list(_text(lp).encode()))
                    for _, lp in _top(position, k)
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs, k: int, text_offset: int = 0
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = text_offset
    for tid, position in zip(token_ids, logprobs, strict=False):
        sampled = position[tid]
        text = _text(sampled)
        out.tokens.append(text)
        out.token_logprobs.append(sampled.logprob)
        out.text_offset.append(offset)
        offset += len(text)
        out.top_logprobs.append(
            {_text(lp): lp.logprob for _, lp in _top(position, k)} if k else None
        )
    return out


def echo_logprobs(
    token_ids: Sequence[int],
    prompt_logprobs: PromptLogprobs | None,
    k: int,
    decode: Callable[[list[int]], str],
) -> CompletionLogprobs:
    """An echoed prompt's completion logprobs: the first token (and any the engine did not
    score) with None, as OpenAI's and vLLM's echo give it; ``decode`` names those tokens."""
    out = CompletionLogprobs()
    offset = 0
    for i, tid in enumerate(token_ids):
        position = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
        entry = position.get(tid) if position is not None else None
        text = _text(entry) if entry is not None else decode([tid])
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None or entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(
            {_text(lp): lp.logprob for _, lp in _top(position, k)} if k else None
        )
    return out


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """Two runs of tokens as one (an echoed prompt, then its completion)."""
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def prompt_logprobs_field(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsField | None:
    """vLLM's ``prompt_logprobs`` response field: per position, token id -> its Logprob."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            tid: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in position.items()
        }
        for position in prompt_logprobs
    ]
