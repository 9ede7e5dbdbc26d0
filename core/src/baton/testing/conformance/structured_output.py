"""Conformance suite for structured-output backends: subclass ``StructuredOutputConformance``.

    from baton.testing.conformance.structured_output import StructuredOutputConformance

    class TestMyBackend(StructuredOutputConformance):
        name = "mine"            # the registered name; the backend is made by its factory

Override ``make_backend(tokenizer, vocab_size)`` to build the backend another
way (e.g. with non-default settings). The suite uses the default model's real
tokenizer (SmolLM2, byte-level BPE, EOS ``<|im_end|>``) and a *model*
vocabulary ``extra_vocab`` rows wider than the tokenizer's, as models with a
padded embedding have: those rows must never be allowed. Expected allowed sets
are computed by brute force over the decoded vocabulary, so "fill_bitmask marks
exactly the allowed tokens" is checked, not sampled.

The contract checked (see ``baton.interfaces``): ``compile`` accepts every spec
kind and raises StructuredOutputError for a bad one, from several threads at
once; ``allocate_bitmask`` is int32 [rows, ceil(vocab/32)], all allowed;
``fill_bitmask`` writes one row and nothing else; ``accept_tokens`` advances over
all tokens or over none; a grammar ends with the EOS token and then is
terminated; ``rollback`` restores the earlier state.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from baton.errors import StructuredOutputError
from baton.sampling_params import StructuredOutputSpec

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    },
    "required": ["name", "age", "address", "tags"],
}
VALID_DOC = {
    "name": "Ada",
    "age": 36,
    "address": {"city": "London", "zip": "01234"},
    "tags": ["b", "a"],
}
CHOICES = ["yes", "no", "maybe so"]
#: Finite languages, so random walks over the allowed tokens end.
FINITE_REGEXES = [r"(cat|dog)s? [0-9]{2}", r"[A-C]{1,3}-(x|yz)"]
EBNF = 'root ::= "(" [0-9] [0-9]? ")" | "none"'


def spec_of_every_kind() -> dict[str, StructuredOutputSpec]:
    return {
        "json": StructuredOutputSpec(json=NESTED_SCHEMA),  # type: ignore[arg-type]
        "json_object": StructuredOutputSpec(json_object=True),
        "regex": StructuredOutputSpec(regex=FINITE_REGEXES[0]),
        "choice": StructuredOutputSpec(choice=CHOICES),
        "grammar": StructuredOutputSpec(grammar=EBNF),
    }


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    """The token ids whose bit is set in ``bitmask[row]`` (xgrammar layout: bit t%32 of word t//32)."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


class StructuredOutputConformance:
    """Behaviour every structured-output backend must show. Subclass it in a plugin's tests."""

    #: The backend's registered name (``structured_output.backend``).
    name: str = ""
    #: Model vocabulary rows past the tokenizer's vocabulary (an embedding padded to a multiple of 64).
    extra_vocab: int = 64

    # ------------------------------------------------------------------ fixtures

    def make_backend(self, tokenizer: Any, vocab_size: int) -> Any:
        """Build the backend under test; by default through its registered factory with default settings."""
        from baton.config import BatonConfig
        from baton.plugins.registry import get_registry

        entry = get_registry().get("structured_output", self.name)
        config = BatonConfig.load()
        settings = entry.settings(config)
        return entry.create(config, settings, tokenizer, vocab_size)

    # class-scoped fixtures are classmethods: pytest runs them once per class, on no instance
    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls) -> Any:
        from transformers import AutoTokenizer

        from baton.model.loader import DEFAULT_ALIAS, resolve_model

        return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_ALIAS))

    @pytest.fixture(scope="class")
    @classmethod
    def vocab_size(cls, tokenizer: Any) -> int:
        return len(tokenizer) + cls.extra_vocab

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, tokenizer: Any, vocab_size: int) -> Any:
        return cls().make_backend(tokenizer, vocab_size)

    @pytest.fixture(scope="class")
    @classmethod
    def texts(cls, tokenizer: Any) -> list[str]:
        """The text of every token of the tokenizer, alone."""
        return tokenizer.batch_decode(
            [[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False
        )

    @pytest.fixture(scope="class")
    @classmethod
    def eos(cls, tokenizer: Any) -> int:
        return tokenizer.eos_token_id

    # ------------------------------------------------------------------ helpers

    def fresh(self, backend: Any, spec: StructuredOutputSpec) -> Any:
        return backend.matcher(backend.compile(spec))

    def allowed(self, backend: Any, matcher: Any, vocab_size: int) -> set[int]:
        bitmask = backend.allocate_bitmask(1)
        matcher.fill_bitmask(bitmask, 0)
        return allowed_ids(bitmask, 0, vocab_size)

    def expected(self, texts: list[str], out: str, is_prefix: Callable[[str], bool]) -> set[int]:
        """Brute force: tokens whose text, appended to ``out``, keeps it a prefix of the language."""
        return {i for i, t in enumerate(texts) if t and is_prefix(out + t)}

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ registration and compile

    def test_registered_under_its_name(self) -> None:
        from baton.plugins.registry import get_registry

        assert self.name, "set the class attribute `name` to the backend's registered name"
        assert self.name in get_registry().names("structured_output")

    @pytest.mark.parametrize("kind", list(spec_of_every_kind()))
    def test_compiles_every_spec_kind(self, backend: Any, kind: str) -> None:
        matcher = self.fresh(backend, spec_of_every_kind()[kind])
        assert not matcher.is_terminated()

    @pytest.mark.parametrize(
        "spec",
        [
            StructuredOutputSpec(regex="[a-"),
            StructuredOutputSpec(grammar="root ::= undefined_rule"),
            StructuredOutputSpec(grammar="this is not EBNF"),
            StructuredOutputSpec(json='{"type": "no-such-type"}'),
        ],
        ids=["regex", "grammar-undefined-rule", "grammar-syntax", "json-schema"],
    )
    def test_invalid_spec_raises_structured_output_error(
        self, backend: Any, spec: StructuredOutputSpec
    ) -> None:
        with pytest.raises(StructuredOutputError) as info:
            backend.compile(spec)
        assert str(info.value), "the error must say what is wrong"

    def test_compile_is_thread_safe(self, backend: Any, tokenizer: Any, eos: int) -> None:
        lengths = list(range(1, 9)) * 3
        results: dict[int, Any] = {}
        errors: list[BaseException] = []

        def work(i: int, k: int) -> None:
            try:
                results[i] = backend.compile(StructuredOutputSpec(regex=f"a{{{k}}}"))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i, k)) for i, k in enumerate(lengths)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for i, k in enumerate(lengths):
            m = backend.matcher(results[i])
            assert m.accept_tokens(self.encode(tokenizer, "a" * k)), f"a{{{k}}} rejects {'a' * k!r}"
            assert m.accept_tokens([eos]) and m.is_terminated()
            m = backend.matcher(results[i])
            assert not m.accept_tokens(self.encode(tokenizer, "a" * (k + 1)))

    # ------------------------------------------------------------------ the bitmask

    def test_bitmask_shape_follows_the_model_vocabulary(
        self, backend: Any, vocab_size: int
    ) -> None:
        bitmask = backend.allocate_bitmask(5)
        assert isinstance(bitmask, torch.Tensor) and bitmask.dtype == torch.int32
        assert tuple(bitmask.shape) == (5, -(-vocab_size // 32))
        assert allowed_ids(bitmask, 4, vocab_size) == set(range(vocab_size)), (
            "a fresh bitmask allows everything"
        )

    def test_fill_writes_its_row_only(self, backend: Any, vocab_size: int) -> None:
        bitmask = backend.allocate_bitmask(3)
        before = bitmask.clone()
        self.fresh(backend, StructuredOutputSpec(choice=CHOICES)).fill_bitmask(bitmask, 1)
        assert torch.equal(bitmask[0], before[0]) and torch.equal(bitmask[2], before[2])
        assert not torch.equal(bitmask[1], before[1])

    def test_choice_bitmask_is_exact(
        self, backend: Any, tokenizer: Any, texts: list[str], vocab_size: int, eos: int
    ) -> None:
        m = self.fresh(backend, StructuredOutputSpec(choice=CHOICES))

        def prefix(s: str) -> bool:
            return any(c.startswith(s) for c in CHOICES)

        assert self.allowed(backend, m, vocab_size) == self.expected(texts, "", prefix)
        assert m.accept_tokens(self.encode(tokenizer, "ma"))
        assert self.allowed(backend, m, vocab_size) == self.expected(texts, "ma", prefix)
        assert m.accept_tokens(self.encode(tokenizer, "ybe so"))
        assert self.allowed(backend, m, vocab_size) == {eos}, "a complete output allows only EOS"

    def test_regex_bitmask_is_exact(
        self, backend: Any, tokenizer: Any, texts: list[str], vocab_size: int, eos: int
    ) -> None:
        m = self.fresh(backend, StructuredOutputSpec(regex="[0-9]{2,3}"))

        def prefix(s: str) -> bool:
            return re.fullmatch(r"[0-9]{1,3}", s) is not None

        assert self.allowed(backend, m, vocab_size) == self.expected(texts, "", prefix)
        assert m.accept_tokens(self.encode(tokenizer, "12"))
        # complete ("12") and extendable ("123"): digits or EOS
        assert self.allowed(backend, m, vocab_size) == self.expected(texts, "12", prefix) | {eos}

    def test_padding_rows_of_the_model_vocabulary_are_never_allowed(
        self, backend: Any, tokenizer: Any, vocab_size: int
    ) -> None:
        padding = set(range(len(tokenizer), vocab_size))
        for spec in spec_of_every_kind().values():
            assert not self.allowed(backend, self.fresh(backend, spec), vocab_size) & padding, (
                spec.kind
            )

    # ------------------------------------------------------------------ matching

    def test_json_schema_accepts_a_valid_document_then_eos(
        self, backend: Any, tokenizer: Any, eos: int
    ) -> None:
        m = self.fresh(backend, spec_of_every_kind()["json"])
        assert m.accept_tokens(self.encode(tokenizer, json.dumps(VALID_DOC)))
        assert not m.is_terminated(), "terminated only once EOS is accepted"
        assert m.accept_tokens([eos]) and m.is_terminated()
        assert not m.accept_tokens(self.encode(tokenizer, " ")), (
            "nothing is accepted after termination"
        )

    def test_rejection_leaves_the_matcher_unchanged(
        self, backend: Any, tokenizer: Any, vocab_size: int
    ) -> None:
        m = self.fresh(backend, spec_of_every_kind()["json"])
        assert m.accept_tokens(self.encode(tokenizer, '{"name": "Ada", '))
        before = self.allowed(backend, m, vocab_size)
        bad = self.encode(tokenizer, '"age": "thirty"')  # a string where an integer belongs
        assert not m.accept_tokens(bad)
        assert self.allowed(backend, m, vocab_size) == before
        assert m.accept_tokens(self.encode(tokenizer, '"age": 30'))

    def test_out_of_vocabulary_and_eos_too_early_are_rejected(
        self, backend: Any, vocab_size: int, eos: int
    ) -> None:
        m = self.fresh(backend, StructuredOutputSpec(choice=CHOICES))
        assert not m.accept_tokens([vocab_size - 1])
        assert not m.accept_tokens([eos]), "EOS before the output is complete"
        assert not m.is_terminated()

    def test_matchers_of_one_grammar_are_independent(
        self, backend: Any, tokenizer: Any, vocab_size: int
    ) -> None:
        compiled = backend.compile(StructuredOutputSpec(choice=CHOICES))
        a, b = backend.matcher(compiled), backend.matcher(compiled)
        start = self.allowed(backend, b, vocab_size)
        assert a.accept_tokens(self.encode(tokenizer, "no"))
        assert self.allowed(backend, b, vocab_size) == start

    def test_rollback_restores_earlier_states(
        self, backend: Any, tokenizer: Any, vocab_size: int, eos: int
    ) -> None:
        m = self.fresh(backend, spec_of_every_kind()["json"])
        tokens = self.encode(tokenizer, json.dumps(VALID_DOC))
        k = len(tokens) // 2
        assert m.accept_tokens(tokens[:k])
        at_k = self.allowed(backend, m, vocab_size)
        assert m.accept_tokens(tokens[k:])
        m.rollback(len(tokens) - k)
        assert self.allowed(backend, m, vocab_size) == at_k
        assert m.accept_tokens(tokens[k:]) and m.accept_tokens([eos]) and m.is_terminated()
        m.rollback(1)
        assert not m.is_terminated()
        assert m.accept_tokens([eos]) and m.is_terminated()
        m.rollback(0)
        assert m.is_terminated()

    @pytest.mark.parametrize("kind", ["regex", "choice", "grammar"])
    def test_random_walks_over_allowed_tokens_stay_in_the_language(
        self, backend: Any, tokenizer: Any, vocab_size: int, eos: int, kind: str
    ) -> None:
        """Every allowed token is accepted, and every walk ends in a full match."""
        if kind == "regex":
            specs = [(StructuredOutputSpec(regex=r), re.compile(r)) for r in FINITE_REGEXES]
        elif kind == "choice":
            specs = [
                (
                    StructuredOutputSpec(choice=CHOICES),
                    re.compile("|".join(map(re.escape, CHOICES))),
                )
            ]
        else:
            specs = [(StructuredOutputSpec(grammar=EBNF), re.compile(r"\([0-9][0-9]?\)|none"))]
        rng = random.Random(1234)
        bitmask = backend.allocate_bitmask(1)
        for spec, pattern in specs:
            compiled = backend.compile(spec)
            for _ in range(10):
                m = backend.matcher(compiled)
                out: list[int] = []
                for _ in range(64):
                    m.fill_bitmask(bitmask, 0)
                    allowed = sorted(allowed_ids(bitmask, 0, vocab_size))
                    assert allowed, f"{spec.kind}: no token allowed after {tokenizer.decode(out)!r}"
                    tok = rng.choice(allowed)
                    assert m.accept_tokens([tok]), (
                        f"allowed token {tok} rejected after {tokenizer.decode(out)!r}"
                    )
                    if m.is_terminated():
                        assert tok == eos
                        break
                    out.append(tok)
                assert m.is_terminated(), (
                    f"{spec.kind}: walk did not end: {tokenizer.decode(out)!r}"
                )
                text = tokenizer.decode(out)
                assert pattern.fullmatch(text), (
                    f"{spec.kind}: {text!r} does not match {pattern.pattern!r}"
                )
