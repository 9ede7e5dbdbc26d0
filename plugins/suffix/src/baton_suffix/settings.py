"""``[speculative.suffix]``: the suffix speculator's settings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SuffixSettings(BaseModel):
    """``[speculative.suffix]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_depth: int = Field(64, ge=2, le=1024)
    """Longest string the tries hold: a match plus the draft after it (a match is kept at
    most max_depth - speculative.num_tokens long so that a whole draft fits)."""
    max_cached_requests: int = Field(1000, ge=0)
    """Outputs of finished requests kept in the global trie (oldest evicted first); 0: none,
    each request drafts from its own tokens only."""
    max_spec_factor: float = Field(1.0, gt=0, le=64)
    """A draft is at most this times the match length long (and at most
    speculative.num_tokens): a longer match allows a longer draft."""
    min_token_prob: float = Field(0.1, ge=0, le=1)
    """A draft stops before the token where the product of the continuations' empirical
    probabilities (count of child / count of node) falls below this."""
