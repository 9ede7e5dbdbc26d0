"""The xgrammar backend: compile specs with one GrammarCompiler, match with GrammarMatcher.

Thread safety: ``compile`` runs on the kernel's thread pool, several at a time;
xgrammar's GrammarCompiler is thread-safe and caches compiled grammars itself.
A matcher belongs to one request and is used from the engine thread only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

from baton.errors import StructuredOutputError

if TYPE_CHECKING:
    from baton.sampling_params import StructuredOutputSpec
    from baton_xgrammar.plugin import XGrammarSettings

#: xgrammar prefixes its messages with "[time] /path/file.cc:line: "; users need only the text.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
#: What a JSON-object spec means (OpenAI's response_format json_object): any object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class XGrammarMatcher:
    """One request's position in its grammar (``baton.interfaces.GrammarMatcher``)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over all of ``token_ids``, or over none: a rejected token rolls back the ones before it."""
        m = self._matcher
        for k, tok in enumerate(token_ids):
            if not m.accept_token(tok):
                if k:
                    m.rollback(k)
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class XGrammarBackend:
    """``baton.interfaces.StructuredOutputBackend`` over xgrammar for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, settings: XGrammarSettings) -> None:
        self.vocab_size = vocab_size
        self.settings = settings
        # the model's vocabulary, not the tokenizer's: logits rows past the tokenizer's
        # tokens (embedding padding) exist and must be masked too
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        threads = settings.max_threads or min(8, os.cpu_count() or 1)
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info,
            max_threads=threads,
            cache_enabled=True,
            cache_limit_bytes=settings.cache_limit_bytes,
        )

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind == "json":
                return self._compile_json(spec.json)  # type: ignore[arg-type]
            if kind == "json_object":
                return self._compile_json(JSON_OBJECT_SCHEMA)
            if kind == "regex":
                return self.compiler.compile_regex(spec.regex)  # type: ignore[arg-type]
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(spec.choice))  # type: ignore[arg-type]
            if kind == "grammar":
                return self.compiler.compile_grammar(spec.grammar)  # type: ignore[arg-type]
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as these
            raise StructuredOutputError(
                f"xgrammar cannot compile the {kind} spec: {_clean(e)}"
            ) from e
        raise StructuredOutputError(
            f"the xgrammar backend does not support structured-output kind {kind!r}"
        )

    def _compile_json(self, schema: str) -> xgr.CompiledGrammar:
        s = self.settings
        return self.compiler.compile_json_schema(
            schema,
            any_whitespace=s.any_whitespace,
            max_whitespace_cnt=s.max_whitespace_cnt,
            strict_mode=s.strict_mode,
        )

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(e: BaseException) -> str:
    return _CPP_PREFIX.sub("", str(e)).strip() or type(e).__name__
