"""``SamplingParams.bad_words`` as the token sequences the sampler bans (vLLM's rule)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Each word's token ids, as it starts a text and, when that tokenizes differently, after a
    space (the word in the middle of a text): vLLM's ``SamplingParams.update_from_tokenizer``.

    The space variant is kept only when it has as many tokens as the other and a different
    first token (a tokenizer that splits off the space gives nothing new to ban).
    """
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            continue
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return out
