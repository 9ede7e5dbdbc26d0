"""SamplingParams (vLLM's field names) and the structured-output spec.

Both are msgspec structs because they cross the frontend -> engine boundary
inside EngineCoreRequest. Validation runs in ``__post_init__``, so a bad value
fails where the user built it, and again if a malformed frame carries one.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import msgspec

from baton.errors import InvalidRequestError, StructuredOutputError

MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput carries while a request streams."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputSpec(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):
    """Constrain a request's output. Exactly one field is set.

    ``json`` is a JSON schema (a dict, or its JSON text); ``json_object`` asks for
    any JSON object; ``regex`` a full match; ``choice`` one of the strings;
    ``grammar`` an EBNF grammar (GBNF dialect, as xgrammar reads it).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # accept a schema dict, keep its compact text
            self.json = json_dumps_compact(self.json)
        kinds = self.kinds()
        if len(kinds) != 1:
            raise StructuredOutputError(
                "a structured-output spec sets exactly one of json, json_object, regex, "
                f"choice, grammar; got {kinds or 'none'}"
            )
        if self.json is not None:
            try:
                json.loads(self.json)
            except ValueError as e:
                raise StructuredOutputError(
                    f"structured_outputs.json is not valid JSON: {e}"
                ) from e
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise StructuredOutputError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}"
            )

    def kinds(self) -> list[str]:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        return set_

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def key(self) -> tuple[str, str]:
        """A hashable (kind, text) identifying the compiled grammar, for caching."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def json_dumps_compact(obj: Any) -> str:
    # key order kept: a schema's property order is the order the output's properties take
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    """How to sample one request, with vLLM's names and defaults.

    ``temperature=0`` is greedy. ``top_k=0`` (or -1) and ``top_p=1`` disable those
    filters. ``seed`` makes sampling reproducible whatever else is in the batch.
    ``logprobs=k`` returns the sampled token's logprob plus the top k.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputSpec | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(
            self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0 (0 = greedy)"
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 1, or 0 / -1 to disable")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "must be >= 1",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            self.logprobs,
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "must be in [-2, 2]",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "must be in [-2, 2]",
        )
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be in (0, 2]",
        )
        _check(
            self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed, "must be in [0, 2**63)"
        )
        if self.stop is not None:
            _check(all(self.stop), "stop", self.stop, "must not contain empty strings")
        if self.stop_token_ids is not None:
            _check(
                all(t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                self.stop_token_ids,
                "must be token ids >= 0",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidRequestError(f"SamplingParams.{field} {rule}, got {value!r}")
