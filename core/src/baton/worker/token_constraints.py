"""logit_bias, allowed_token_ids and bad words: what they do to one step's logits.

``token_constraints`` gathers them for the sampling rows that have any (a Python loop over
those rows only; a step without them costs one numpy ``any``); ``TokenConstraints.apply``
changes the logits in place, batched: one index_put for the biases, one masked fill for
the allowed tokens, one for the banned ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baton.worker.input_batch import InputBatch


@dataclass
class TokenConstraints:
    """The step's constraints, as flat index tensors into the [N, vocab] logits."""

    #: (rows, token ids, biases) added to the logits
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: (rows [A], allowed [A, vocab] bool): every other token of those rows is -inf
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    #: (rows, token ids) set to -inf: bad words whose prefix was just generated
    bans: tuple[torch.Tensor, torch.Tensor] | None = None

    def mask(self, logits: torch.Tensor) -> None:
        """The -inf masks (allowed tokens, bad words), in place; applying them twice is harmless."""
        if self.allowed is not None:
            rows, allowed = self.allowed
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        if self.bans is not None:
            logits[self.bans] = float("-inf")

    def add_bias(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Add the biases in place; return the biased rows as they were (to restore them)."""
        if self.bias is None:
            return None
        rows, ids, values = self.bias
        before = logits[rows]
        logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
        return before


def token_constraints(
    batch: InputBatch,
    rows: np.ndarray,
    vocab_size: int,
    device: torch.device,
    offsets: np.ndarray | None = None,
) -> TokenConstraints | None:
    """The constraints of the sampling ``rows`` (None when none of them has any).

    A bad word of one token is always banned; a longer one bans its last token where the
    row's output (with the first ``offsets[i]`` drafts, when verifying) ends with the rest.
    """
    which = np.nonzero(batch.constrained[rows])[0]
    if not len(which):
        return None
    b_rows: list[int] = []
    b_ids: list[int] = []
    b_vals: list[float] = []
    a_rows: list[int] = []
    a_ids: list[list[int]] = []
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i in which.tolist():
        row = int(rows[i])
        sp = batch.constraints[row]
        assert sp is not None
        for tid, value in (sp.logit_bias or {}).items():
            if tid < vocab_size:  # the check bounds them by the tokenizer's vocabulary
                b_rows.append(i)
                b_ids.append(tid)
                b_vals.append(value)
        if sp.allowed_token_ids:
            a_rows.append(i)
            a_ids.append([t for t in sp.allowed_token_ids if t < vocab_size])
        if sp.bad_words_token_ids:
            drafts = int(offsets[i]) if offsets is not None else 0
            out = batch.output_token_ids(row, drafts).tolist()
            for word in sp.bad_words_token_ids:
                prefix = word[:-1]
                ends_with = not prefix or out[-len(prefix) :] == prefix
                if len(out) >= len(prefix) and ends_with and word[-1] < vocab_size:
                    ban_rows.append(i)
                    ban_ids.append(word[-1])

    def t(values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    c = TokenConstraints()
    if b_rows:
        c.bias = (t(b_rows, torch.long), t(b_ids, torch.long), t(b_vals, torch.float32))
    if a_rows:
        allowed = np.zeros((len(a_rows), vocab_size), dtype=bool)
        for k, ids in enumerate(a_ids):
            allowed[k, ids] = True
        c.allowed = (t(a_rows, torch.long), torch.from_numpy(allowed).to(device))
    if ban_rows:
        c.bans = (t(ban_rows, torch.long), t(ban_ids, torch.long))
    return c
