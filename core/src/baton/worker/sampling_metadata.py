"""What the sampler needs of a step's sampling rows, read from the persistent batch: the
``SamplingMetadata``, and whether the sampler reads nothing but each row's argmax."""

from __future__ import annotations

import numpy as np
import torch

from baton.worker.input_batch import InputBatch
from baton.worker.sampler import SamplingMetadata
from baton.worker.token_constraints import token_constraints


def argmax_only(batch: InputBatch, rows: np.ndarray) -> bool:
    """Whether sampling ``rows`` reads nothing of their logits but each row's argmax
    (``SamplingParams.argmax_only`` of every row: greedy, without logprobs, penalties,
    min_tokens, logit_bias, allowed tokens, bad words or a grammar)."""
    return bool(len(rows) and batch.argmax_only[rows].all())


def penalised(presence: np.ndarray, frequency: np.ndarray, repetition: np.ndarray) -> np.ndarray:
    """Per row: whether its presence, frequency or repetition penalty changes its logits."""
    return (presence != 0) | (frequency != 0) | (repetition != 1)


def sampling_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    vocab_size: int,
    device: torch.device,
    offsets: np.ndarray | None = None,
) -> SamplingMetadata:
    """The SamplingMetadata of the sampling ``rows`` (aligned with the logits rows).

    ``offsets`` (verifying drafts): row i samples the token after the first
    ``offsets[i]`` drafts, which count as output before it (seeds, min_tokens, penalties).
    """
    temp = batch.temperature[rows]
    greedy = temp == 0.0
    md = SamplingMetadata(all_greedy=bool(greedy.all()))

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    n_out = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    if offsets is not None:
        n_out = n_out + offsets
    if not md.all_greedy:
        md.greedy = t(greedy)
        md.temperature = t(np.where(greedy, np.float32(1.0), temp))
        rnd = ~greedy
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        if (top_k[rnd] > 0).any():
            md.top_k = t(top_k)
        if (top_p[rnd] < 1.0).any():
            md.top_p = t(top_p)
        if (min_p[rnd] > 0.0).any():
            md.min_p = t(min_p)
        has_seed = batch.has_seed[rows]
        if has_seed.any():
            seeds = batch.seed[rows]
            md.seeds = [
                (int(seeds[i]), int(n_out[i])) if has_seed[i] else None for i in range(len(rows))
            ]

    pres, freq, rep = (
        batch.presence_penalty[rows],
        batch.frequency_penalty[rows],
        batch.repetition_penalty[rows],
    )
    pen = penalised(pres, freq, rep)
    if pen.any():
        p_idx = np.nonzero(pen)[0]
        p_rows = rows[p_idx]
        md.penalty_rows = t(p_idx)
        md.prompt_ids = t(
            _padded([batch.token_ids[r, : batch.num_prompt_tokens[r]] for r in p_rows], vocab_size)
        )
        offs = offsets[p_idx].tolist() if offsets is not None else [0] * len(p_rows)
        outs = [batch.output_token_ids(r, o) for r, o in zip(p_rows, offs, strict=True)]
        md.output_ids = t(_padded(outs, vocab_size))
        md.presence_penalty = t(pres[p_idx]) if (pres[p_idx] != 0).any() else None
        md.frequency_penalty = t(freq[p_idx]) if (freq[p_idx] != 0).any() else None
        md.repetition_penalty = t(rep[p_idx]) if (rep[p_idx] != 1).any() else None

    # only the rows still below their min_tokens (a Python loop over every row costs per step)
    for i in np.nonzero(n_out < batch.min_tokens[rows])[0].tolist():
        ids = batch.min_tokens_stop_ids[rows[i]]
        if ids is not None:
            md.min_tokens_bans.append((i, ids))
    lp = batch.num_logprobs[rows]
    if (lp >= 0).any():
        md.num_logprobs = lp.tolist()
    md.constraints = token_constraints(batch, rows, vocab_size, device, offsets)
    return md


def _padded(seqs: list[np.ndarray], pad: int) -> np.ndarray:
    width = max(1, max(len(s) for s in seqs))
    out = np.full((len(seqs), width), pad, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out
