"""The model runner's sampling: one token per sampling request (the grammar's bitmask
applied), draft verification for speculative decoding, a request sampled alone when the batch
fails to sample, and the prompt tokens' logprobs (prompt_logprobs).

A mixin of ``baton.worker.model_runner.ModelRunner``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from baton.protocol import GrammarOutput, ModelRunnerOutput, TokenLogprobs
from baton.worker.containment import describe, log_contained
from baton.worker.sampler import Sampler, apply_bitmask
from baton.worker.sampling_metadata import sampling_metadata
from baton.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from baton.worker.input_batch import InputBatch
    from baton.worker.runner_hooks import ModelRunnerHooks

log = logging.getLogger("baton.worker.model_runner")  # the runner's: its messages keep their logger

#: Prompt positions scored per log_softmax (prompt_logprobs): bounds the extra memory a long
#: prompt chunk takes (rows x vocab floats) beside its logits.
PROMPT_SCORE_ROWS = 256


class SamplingMixin:
    """The sampling half of the model runner."""

    device: torch.device
    vocab_size: int
    hooks: ModelRunnerHooks
    input_batch: InputBatch
    sampler: Sampler
    #: prompt logprobs of requests whose prompt is still being computed (chunked prefill)
    _prompt_lps: dict[str, list[TokenLogprobs]]

    def _score_prompts(
        self, logits: torch.Tensor, inputs: StepInputs, out: ModelRunnerOutput
    ) -> None:
        """Log-probabilities of the prompt tokens this step computed (prompt_logprobs), kept
        until the request's prompt is done; then in ``out.prompt_logprobs``."""
        rows = inputs.prompt_rows
        assert rows is not None
        failed = out.failed or {}
        try:
            targets = torch.from_numpy(rows.targets).to(logits.device)
            ks = [k for k, c in zip(rows.num_logprobs, rows.counts, strict=True) for _ in range(c)]
            scored: list[TokenLogprobs | None] = []
            for a in range(0, len(ks), PROMPT_SCORE_ROWS):  # a long chunk's float32 copy in parts
                b = a + PROMPT_SCORE_ROWS
                raw = torch.log_softmax(logits[a:b].float(), dim=-1)
                scored += Sampler.logprobs(raw, targets[a:b], ks[a:b])
        except Exception as e:  # those requests fail; the others' tokens stand
            for rid in rows.req_ids:
                failed[rid] = describe(e)
                self._prompt_lps.pop(rid, None)
                log_contained(rid, "to score its prompt", e)
            out.failed = failed
            keep = [i for i, rid in enumerate(out.req_ids) if rid not in failed]  # not in req_ids
            out.req_ids = [out.req_ids[i] for i in keep]
            out.sampled_token_ids = [out.sampled_token_ids[i] for i in keep]
            if out.logprobs:
                out.logprobs = {r: lp for r, lp in out.logprobs.items() if r not in failed}
            return
        at = 0
        for rid, count in zip(rows.req_ids, rows.counts, strict=True):
            self._prompt_lps.setdefault(rid, []).extend(
                lp for lp in scored[at : at + count] if lp is not None
            )
            at += count
        done = {rid for rid in rows.req_ids if rid not in failed} & set(out.req_ids)
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if rid in done and sampled:  # its last prompt chunk: the first token was sampled
                if out.prompt_logprobs is None:
                    out.prompt_logprobs = {}
                out.prompt_logprobs[rid] = self._prompt_lps.pop(rid)

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs, grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        """One token per sampling request; a request verifying drafts gets the drafts the
        model accepts and one token of its own (``_verify``). When the batch fails to sample,
        each request is sampled alone, and only those that fail alone are reported failed. A
        runner whose hooks do not sample (a rank with partial or no logits) returns an empty
        output."""
        if not self.hooks.samples():
            return ModelRunnerOutput()
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] | None = None
        failed: dict[str, str] = {}
        rids = inputs.sample_req_ids
        if rids:
            try:
                tokens, lps = self._sample_rows(
                    logits, rids, inputs.sample_rows, grammar, inputs.sample_offsets
                )
            except Exception as e:  # rare: pay for row-by-row sampling only now
                tokens, lps = self._sample_each(logits, inputs, grammar, failed)
                if not failed:  # no request to blame (each row that failed logged itself)
                    log.warning(
                        "sampling %d requests together failed (%s); each alone succeeded",
                        len(rids),
                        describe(e),
                    )
            if inputs.drafts:
                sampled, logprobs = _verify(inputs, tokens, lps, failed)
            else:
                sampled = {
                    rid: [tok] for rid, tok in zip(rids, tokens, strict=True) if tok is not None
                }
                if lps is not None:
                    logprobs = {
                        rid: [lp] for rid, lp in zip(rids, lps, strict=True) if lp is not None
                    }
        req_ids = [rid for rid in inputs.req_ids if rid not in failed] if failed else inputs.req_ids
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(rid, []) for rid in req_ids],
            logprobs=logprobs,
            failed=failed or None,
        )

    def _sample_rows(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        rows: np.ndarray,
        grammar: GrammarOutput | None,
        offsets: np.ndarray | None = None,
    ) -> tuple[list[int | None], list[TokenLogprobs | None] | None]:
        """Sample ``logits`` (aligned with ``req_ids`` and their batch ``rows``, ``offsets``
        past their tokens): tokens, logprobs."""
        if grammar is not None and grammar.req_ids:
            self._apply_grammar(logits, req_ids, grammar, offsets)
        md = sampling_metadata(self.input_batch, rows, self.vocab_size, self.device, offsets)
        out = self.sampler(logits, md)
        return out.token_ids.tolist(), out.logprobs

    def _sample_each(
        self,
        logits: torch.Tensor,
        inputs: StepInputs,
        grammar: GrammarOutput | None,
        failed: dict[str, str],
    ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """Sample every request alone (after the batch failed); a request that fails goes to ``failed``.

        Greedy and seeded rows get the tokens the batch would have given them
        (a seeded draw depends only on its seed and position); unseeded ones draw afresh.
        """
        tokens: list[int | None] = []
        lps: list[TokenLogprobs | None] = []
        for i, rid in enumerate(inputs.sample_req_ids):
            try:
                offsets = inputs.sample_offsets
                [tok], row_lps = self._sample_rows(
                    logits[i : i + 1],
                    [rid],
                    inputs.sample_rows[i : i + 1],
                    grammar,
                    offsets[i : i + 1] if offsets is not None else None,
                )
            except Exception as e:
                failed[rid] = describe(e)
                log_contained(rid, "to sample", e)
                tok, row_lps = None, None
            tokens.append(tok)
            lps.append(row_lps[0] if row_lps else None)
        return tokens, lps

    def _apply_grammar(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        grammar: GrammarOutput,
        offsets: np.ndarray | None = None,
    ) -> None:
        """Mask the rows of ``logits`` (aligned with ``req_ids`` and their ``offsets`` past the
        request's tokens) that have a bitmask row: a request's j-th row in the bitmask masks
        its logits row at offset j (a request verifying drafts has one per position)."""
        pos = offsets.tolist() if offsets is not None else [0] * len(req_ids)
        where = {(rid, int(off)): i for i, (rid, off) in enumerate(zip(req_ids, pos, strict=True))}
        seen: dict[str, int] = {}
        mask_rows, logit_rows = [], []
        for j, rid in enumerate(grammar.req_ids):
            off = seen[rid] = seen.get(rid, -1) + 1
            i = where.get((rid, off))
            if i is not None:  # a request in a mid-prompt chunk samples nothing this step
                mask_rows.append(j)
                logit_rows.append(i)
        if not logit_rows:
            return
        bitmask = torch.as_tensor(grammar.bitmask)
        if len(mask_rows) != bitmask.shape[0]:
            bitmask = bitmask[torch.tensor(mask_rows)]
        apply_bitmask(logits, bitmask, torch.tensor(logit_rows, device=logits.device))


def _verify(
    inputs: StepInputs,
    tokens: list[int | None],
    lps: list[TokenLogprobs | None] | None,
    failed: dict[str, str],
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]] | None]:
    """Tokens (and logprobs) per request of a step that verified drafts.

    Row j of a verifying request drew the token that follows its first j drafts, as
    decoding would have drawn it (greedy: the argmax; sampling: the same seeded or
    fresh draw). Draft j is accepted when it equals that token, and the request gets
    its accepted drafts followed by the first token that differs (or, all accepted, the
    token after the last draft). A draft is a point guess, so this is speculative
    sampling's accept test (keep x with probability p(x) / q(x) = p(x), else draw from
    p without x): every token returned has the distribution decoding would give it.
    """
    assert inputs.drafts is not None and inputs.sample_offsets is not None
    rows: dict[str, dict[int, int]] = {}  # req id -> offset -> index into tokens
    for i, (rid, off) in enumerate(
        zip(inputs.sample_req_ids, inputs.sample_offsets.tolist(), strict=True)
    ):
        if rid not in failed and tokens[i] is not None:
            rows.setdefault(rid, {})[off] = i
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] | None = {} if lps is not None else None
    for rid, at in rows.items():
        drafts = inputs.drafts.get(rid, ())
        out: list[int] = []
        out_lps: list[TokenLogprobs] = []
        for j in range(len(drafts) + 1):
            i = at[j]
            tok = tokens[i]
            assert tok is not None
            out.append(tok)
            if lps is not None and lps[i] is not None:
                out_lps.append(lps[i])  # type: ignore[arg-type]
            if j == len(drafts) or tok != drafts[j]:
                break
        sampled[rid] = out
        if logprobs is not None and out_lps:
            logprobs[rid] = out_lps
    return sampled, logprobs
