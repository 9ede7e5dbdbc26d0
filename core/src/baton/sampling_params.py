"""SamplingParams (vLLM's field names) and the structured-output spec.

Both are msgspec structs because they cross the frontend -> engine boundary
inside EngineCoreRequest. Validation runs in ``__post_init__``, so a bad value
fails where the user built it, and again if a malformed frame carries one.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from typing import Any

import msgspec

from baton.errors import InvalidRequestError, StructuredOutputError

MAX_LOGPROBS = 20
#: Largest |bias| of logit_bias (OpenAI's bound).
MAX_LOGIT_BIAS = 100.0
#: Most sequences one request may ask for (n); the HTTP layer caps at the same value.
MAX_N = 128
#: Exclusive bound of token counts, token ids and top_k: all fit an int32 (and the sampler's int64).
MAX_INT32 = 2**31
#: Exclusive bound of a seed (a non-negative int64).
MAX_SEED = 2**63
#: Temperatures below this are greedy (0): smaller ones overflow the scaled float32 logits.
MIN_TEMPERATURE = 1e-5


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

    ``temperature=0`` (or below 1e-5) is greedy. ``top_k=0`` (or -1) and ``top_p=1`` disable those
    filters. ``seed`` makes sampling reproducible whatever else is in the batch.
    ``logprobs=k`` returns the sampled token's logprob plus the top k;
    ``prompt_logprobs=k`` each prompt token's logprob (but the first's) plus the top k there.
    ``logit_bias`` adds a bias in [-100, 100] to token ids' logits, ``allowed_token_ids`` keeps
    only those tokens, ``bad_words`` bans each word's last token where its others were just
    generated (vLLM's); the frontend tokenizes them into ``bad_words_token_ids``.
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
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    #: ``bad_words`` as token sequences (InputProcessor.process fills them from ``bad_words``).
    bad_words_token_ids: list[list[int]] | None = None
    #: Arguments for plugins, by name (vLLM's ``extra_args``); the engine reads
    #: ``extra_args["kv_transfer_params"]`` (a dict) for the KV connector (``[kv_transfer]``).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range; InvalidRequestError names the field, the value and the fix.

        Normalises as it goes: ``stop`` a list, ``top_k=-1`` 0, numbers to int / float.
        Bounds need no model here (see baton.validation for the vocabulary and context).
        """
        self.n = _int("n", self.n, 1, MAX_N + 1, f"must be in [1, {MAX_N}]")
        self.temperature = _float("temperature", self.temperature)
        _check(
            self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0 (0 = greedy)"
        )
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0  # as vLLM: dividing float32 logits by less overflows to NaN
        self.top_p = _float("top_p", self.top_p)
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        top_k = _int(
            "top_k", self.top_k, -1, MAX_INT32, "must be in [1, 2**31), or 0 / -1 to disable"
        )
        self.top_k = 0 if top_k == -1 else top_k
        self.min_p = _float("min_p", self.min_p)
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        self.seed = _opt_int("seed", self.seed, 0, MAX_SEED, "must be in [0, 2**63)")
        self.max_tokens = _opt_int(
            "max_tokens", self.max_tokens, 1, MAX_INT32, "must be in [1, 2**31)"
        )
        self.min_tokens = _int("min_tokens", self.min_tokens, 0, MAX_INT32, "must be in [0, 2**31)")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"must be <= max_tokens ({self.max_tokens})",
        )
        self.stop = _stop_strings(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = _int_list(
                "stop_token_ids", self.stop_token_ids, "must hold token ids in [0, 2**31)"
            )
        self.logprobs = _opt_int(
            "logprobs", self.logprobs, 0, MAX_LOGPROBS + 1, f"must be in [0, {MAX_LOGPROBS}]"
        )
        self.prompt_logprobs = _opt_int(
            "prompt_logprobs",
            self.prompt_logprobs,
            0,
            MAX_LOGPROBS + 1,
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        self._validate_token_constraints()
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            _check(-2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be in (0, 2]",
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "must be True or False")
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputSpec),
            "structured_outputs",
            self.structured_outputs,
            "must be a StructuredOutputSpec or None",
        )
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except (ValueError, TypeError):
            _check(False, "output_kind", self.output_kind, "must be a RequestOutputKind")

    def _validate_token_constraints(self) -> None:
        """logit_bias, allowed_token_ids, bad_words (and their token ids): types and bounds."""
        if self.logit_bias is not None:
            _check(
                isinstance(self.logit_bias, dict),
                "logit_bias",
                self.logit_bias,
                "must be a dict of token id -> bias",
            )
            bias = {}
            for tid, value in self.logit_bias.items():
                _check(
                    _is_int(tid) and 0 <= tid < MAX_INT32,
                    "logit_bias",
                    tid,
                    "must have token ids in [0, 2**31) as keys",
                )
                b = _float("logit_bias", value)
                _check(
                    -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS,
                    "logit_bias",
                    value,
                    "must hold biases in [-100, 100]",
                )
                bias[int(tid)] = b
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list(
                "allowed_token_ids", self.allowed_token_ids, "must hold token ids in [0, 2**31)"
            )
            _check(
                bool(self.allowed_token_ids),
                "allowed_token_ids",
                self.allowed_token_ids,
                "must not be empty (leave it out to allow every token)",
            )
        if self.bad_words is not None:
            _check(
                isinstance(self.bad_words, list | tuple)
                and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                self.bad_words,
                "must be a list of non-blank strings",
            )
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            _check(
                isinstance(self.bad_words_token_ids, list | tuple),
                "bad_words_token_ids",
                self.bad_words_token_ids,
                "must be a list of token id lists",
            )
            words = []
            for w in self.bad_words_token_ids:
                ids = _int_list("bad_words_token_ids", w, "must hold token ids in [0, 2**31)")
                _check(bool(ids), "bad_words_token_ids", w, "must hold non-empty lists")
                words.append(ids)
            self.bad_words_token_ids = words
        if self.extra_args is not None:
            _check_extra_args(self.extra_args)

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """``extra_args["kv_transfer_params"]`` (vLLM's route to the KV connector), or None."""
        return None if self.extra_args is None else self.extra_args.get("kv_transfer_params")

    @property
    def constrains_tokens(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad words change the logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Whether sampling reads nothing of the logits but their argmax: greedy, without
        logprobs, penalties, min_tokens, logit bias, allowed tokens, bad words or a grammar."""
        return (
            self.temperature == 0.0
            and self.logprobs is None
            and not self.needs_penalties
            and self.min_tokens == 0
            and not self.constrains_tokens
            and self.structured_outputs is None
        )

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check_extra_args(extra: object) -> None:
    _check(
        isinstance(extra, dict) and all(isinstance(k, str) for k in extra),
        "extra_args",
        extra,
        "must be a dict with str keys",
    )
    params = extra.get("kv_transfer_params")  # type: ignore[attr-defined]
    _check(
        params is None or (isinstance(params, dict) and all(isinstance(k, str) for k in params)),
        "extra_args",
        params,
        'must hold a dict with str keys (or None) under "kv_transfer_params"',
    )


def show_value(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message: huge integers by their size, long reprs cut."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"{'-' if value < 0 else ''}an integer of {abs(value).bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidRequestError(
            f"SamplingParams.{field} {rule}, got {show_value(value)}", param=field
        )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(field: str, value: object, lo: int, hi: int, rule: str) -> int:
    """``value`` as an int in [lo, hi); InvalidRequestError stating ``rule`` otherwise."""
    _check(_is_int(value), field, value, "must be an integer")
    n = int(value)  # type: ignore[call-overload]
    _check(lo <= n < hi, field, n, rule)
    return n


def _opt_int(field: str, value: object, lo: int, hi: int, rule: str) -> int | None:
    if value is None:
        return None
    _check(_is_int(value), field, value, "must be an integer or None")
    return _int(field, value, lo, hi, rule)


def _float(field: str, value: object) -> float:
    """``value`` as a finite float (NaN and infinities are refused)."""
    _check(
        isinstance(value, numbers.Real) and not isinstance(value, bool),
        field,
        value,
        "must be a number",
    )
    try:
        f = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int too large for a float
        f = math.inf
    _check(math.isfinite(f), field, value, "must be a finite number")
    return f


def _int_list(field: str, value: object, rule: str) -> list[int]:
    _check(isinstance(value, list | tuple), field, value, f"must be a list of integers ({rule})")
    out = []
    for v in value:  # type: ignore[union-attr]
        _check(_is_int(v) and 0 <= v < MAX_INT32, field, v, rule)  # type: ignore[operator]
        out.append(int(v))  # type: ignore[call-overload]
    return out


def _stop_strings(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    _check(isinstance(value, list | tuple), "stop", value, "must be a string or a list of strings")
    for s in value:  # type: ignore[union-attr]
        _check(
            isinstance(s, str) and s != "",
            "stop",
            s,
            "must hold non-empty strings (drop the empty ones)",
        )
    return list(value)  # type: ignore[arg-type]
