"""baton's per-position logprobs ({token_id: Logprob}) in OpenAI's chat and completion shapes."""

from __future__ import annotations

from collections.abc import Sequence

from baton.outputs import Logprob, SampleLogprobs
from baton_openai.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


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
