"""A grammar's view of draft tokens (speculative decoding with structured output).

Before scheduling, ``grammar_prefix`` cuts a proposal to the drafts the grammar
allows in a row from the request's current state (short of one that completes it). While the forward runs,
``fill_draft_rows`` writes one bitmask row per verification position: row j
masks the token that follows the first j drafts, so every row samples as plain
decoding would at that point. Both advance the matcher over the drafts and roll
it back: the matcher ends where it started, and after verification the
scheduler has it accept the tokens really kept (``append_and_check_stop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from baton.errors import StructuredOutputError
from baton.interfaces import GrammarMatcher


def grammar_prefix(matcher: GrammarMatcher, drafts: Sequence[int]) -> list[int]:
    """The longest prefix of ``drafts`` the grammar accepts token by token from where it is,
    short of a draft that completes it (its stop token): a completed grammar has no mask for
    the position after it, and the model draws that token itself one row earlier."""
    accepted = 0
    keep = 0
    try:
        for tok in drafts:
            if not matcher.accept_tokens([tok]):
                break
            accepted += 1
            if matcher.is_terminated():
                break
            keep = accepted
    finally:
        matcher.rollback(accepted)
    return list(drafts[:keep])


def fill_draft_rows(matcher: GrammarMatcher, drafts: Sequence[int], bitmask: Any, row: int) -> int:
    """Fill ``bitmask[row + j]`` for j in 0..len(drafts): the tokens allowed after the first j
    drafts. Returns the rows written (1 + len(drafts)). Raises StructuredOutputError when the
    grammar rejects a draft or completes before the last row (drafts are cut to the grammar
    before they are scheduled)."""
    accepted = 0
    try:
        matcher.fill_bitmask(bitmask, row)
        for j, tok in enumerate(drafts):
            if not matcher.accept_tokens([tok]):
                raise StructuredOutputError(
                    f"the grammar rejects draft {j} (token {tok}) of a scheduled proposal"
                )
            accepted += 1
            if matcher.is_terminated():
                raise StructuredOutputError(
                    f"draft {j} (token {tok}) of a scheduled proposal completes the grammar"
                )
            matcher.fill_bitmask(bitmask, row + j + 1)
    finally:
        matcher.rollback(accepted)
    return 1 + len(drafts)
