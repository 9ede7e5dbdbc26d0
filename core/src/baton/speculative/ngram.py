"""The built-in ``ngram`` speculator: prompt lookup.

Drafts are the tokens that followed the most recent earlier occurrence of the
request's last n tokens (continued periodically when that occurrence is so
recent that they run into the end), for the longest n in ``[prompt_lookup_min,
prompt_lookup_max]`` that occurs, searched over the prompt and the output so far
(vLLM's and transformers' prompt lookup decoding). An index from each n-gram to
where it last ended is kept per request and extended by the new tokens only, so
a proposal costs O(new tokens), not O(sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from baton.plugins.hookspecs import hookimpl
from baton.request import Request


class NgramSettings(BaseModel):
    """``[speculative.ngram]``."""

    model_config = ConfigDict(extra="forbid")

    prompt_lookup_min: int = Field(2, ge=1, le=16)
    """Shortest suffix to look up."""
    prompt_lookup_max: int = Field(4, ge=1, le=16)
    """Longest suffix to look up (tried first)."""

    @model_validator(mode="after")
    def _ordered(self) -> NgramSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} > prompt_lookup_max="
                f"{self.prompt_lookup_max}: lower the min or raise the max"
            )
        return self


class _Index:
    __slots__ = ("ends", "upto")

    def __init__(self) -> None:
        #: n-gram -> the position of its last token, most recent occurrence
        self.ends: dict[tuple[int, ...], int] = {}
        #: n-grams ending before this position are indexed
        self.upto = 0


class NgramSpeculator:
    """Prompt lookup over the request's own tokens."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, _Index] = {}

    def propose(self, request: Request, max_tokens: int) -> Sequence[int]:
        tokens = request.all_token_ids
        last = len(tokens) - 1
        idx = self._index.get(request.request_id)
        if idx is None:
            idx = self._index[request.request_id] = _Index()
        ends = idx.ends
        lo, hi = self.min_n, self.max_n
        # index the n-grams ending at positions [upto, last): all but the suffix itself
        for p in range(max(idx.upto, lo - 1), last):
            for n in range(lo, min(hi, p + 1) + 1):
                ends[tuple(tokens[p - n + 1 : p + 1])] = p
        idx.upto = max(idx.upto, last)
        for n in range(min(hi, last), lo - 1, -1):
            p = ends.get(tuple(tokens[last - n + 1 :]))
            if p is not None:
                # copy what followed; a copy that reaches the end goes on with its own start,
                # as the sequence would if it repeats (an overlapping copy, as in LZ77)
                out = tokens[p + 1 : p + 1 + max_tokens]
                period = last - p
                while len(out) < max_tokens:
                    out.append(out[len(out) - period])
                return out
        return []

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        pass  # lookup needs no feedback: accepted tokens are indexed as they arrive

    def finished(self, request: Request) -> None:
        self._index.pop(request.request_id, None)


def _factory(config: Any, settings: NgramSettings | None) -> NgramSpeculator:
    s = settings or NgramSettings()
    return NgramSpeculator(s.prompt_lookup_min, s.prompt_lookup_max)


@hookimpl
def register_speculators(register) -> None:  # type: ignore[no-untyped-def]
    register("ngram", _factory, NgramSettings)
