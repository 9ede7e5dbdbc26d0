"""Plugin module of baton-plugin-xgrammar: registers structured-output backend ``xgrammar``.

Settings come from the ``[structured_output.xgrammar]`` sub-table (or
``BATON_STRUCTURED_OUTPUT__XGRAMMAR__<FIELD>``), validated by ``XGrammarSettings``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from baton import hookimpl

BATON_PLUGIN_API = 1


class XGrammarSettings(BaseModel):
    """``[structured_output.xgrammar]``: how grammars are compiled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_threads: int | None = Field(None, gt=0)
    """Threads of xgrammar's compiler (token-mask cache building); None: the CPU count, at most 8."""
    any_whitespace: bool = True
    """JSON schema / object: allow any whitespace between tokens (False: the compact ``, `` and ``: `` form)."""
    max_whitespace_cnt: int | None = Field(None, gt=0)
    """JSON: at most this many whitespace characters in a row (None: unlimited). Keeps small models
    from padding with whitespace until max_tokens."""
    strict_mode: bool = True
    """JSON schema: refuse properties and items the schema does not name (unless it allows them)."""
    cache_limit_bytes: int = Field(-1, ge=-1)
    """Memory for xgrammar's compiled-grammar cache; -1: unlimited."""


def create_backend(
    config: Any, settings: XGrammarSettings | None, tokenizer: Any, vocab_size: int
) -> Any:
    """The registered factory: ``factory(config, settings, tokenizer, vocab_size)``."""
    # imported here: xgrammar (and torch) load only when a request needs them
    from baton_xgrammar.backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, settings or XGrammarSettings())


@hookimpl
def register_structured_output_backends(register: Any) -> None:
    register("xgrammar", create_backend, settings_model=XGrammarSettings)
