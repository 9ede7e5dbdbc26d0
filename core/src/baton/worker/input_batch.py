"""The persistent input batch: one row per request the runner holds, kept between steps.

Each SchedulerOutput only changes rows: finished/preempted requests leave
(the last row moves into the hole, as vLLM's condense does), cached requests get
their new tokens, blocks and computed count, new requests take a row. Nothing
is rebuilt per step. All state is in preallocated numpy arrays (CPU); the
runner gathers the rows it schedules from them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from baton.errors import ExecutorError
from baton.protocol import NewRequestData
from baton.sampling_params import SamplingParams


class BatchContractError(ExecutorError):
    """The scheduler and the runner disagree on which requests the batch holds: an engine bug,
    not one request's fault, so it fails the step (see ModelRunner.update_states)."""


class InputBatch:
    """Rows ``0 .. num_reqs-1`` are the requests the runner holds, in no particular order."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int | None = None
    ) -> None:
        self.max_num_reqs = max_num_reqs
        #: token ids of new requests are checked against it (None: not checked)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        n = max_num_reqs
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        # prompt + output token ids; num_tokens[i] of row i are valid
        self.token_ids = np.zeros((n, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(n, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(n, dtype=np.int64)
        self.num_computed_tokens = np.zeros(n, dtype=np.int64)
        self.block_table = np.zeros((n, self.max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(n, dtype=np.int64)
        # sampling parameters, one entry per row
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)  # 0 = off
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.presence_penalty = np.zeros(n, dtype=np.float32)
        self.frequency_penalty = np.zeros(n, dtype=np.float32)
        self.repetition_penalty = np.ones(n, dtype=np.float32)
        self.seed = np.zeros(n, dtype=np.int64)
        self.has_seed = np.zeros(n, dtype=bool)
        self.num_logprobs = np.full(n, -1, dtype=np.int64)  # -1 = no logprobs
        self.min_tokens = np.zeros(n, dtype=np.int64)
        #: stop token ids masked while a row is below min_tokens (None: min_tokens is 0)
        self.min_tokens_stop_ids: list[list[int] | None] = [None] * n
        self.num_prompt_logprobs = np.full(n, -1, dtype=np.int64)  # -1 = no prompt logprobs
        #: rows with logit_bias, allowed_token_ids or bad words (their params in ``constraints``)
        self.constrained = np.zeros(n, dtype=bool)
        self.constraints: list[SamplingParams | None] = [None] * n
        #: rows whose sampling reads only the argmax (``SamplingParams.argmax_only``)
        self.argmax_only = np.zeros(n, dtype=bool)
        #: the LoRA adapter id of each row (0: none; LoRARequest.lora_int_id)
        self.lora_id = np.zeros(n, dtype=np.int64)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ------------------------------------------------------------------ changes

    def add_request(self, req: NewRequestData, eos_token_ids: Sequence[int] = ()) -> int:
        """Put a new (or resumed) request in the next free row; return the row.

        The row is filled first and registered last, so a request whose values do
        not fit (an ``OverflowError`` from a sampling parameter) leaves no row behind.
        """
        if req.req_id in self.req_id_to_index:
            raise BatchContractError(
                f"request {req.req_id!r} is already in the model runner's batch"
            )
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise BatchContractError(
                f"more than max_num_seqs={self.max_num_reqs} requests scheduled at once"
            )
        n_prompt = len(req.prompt_token_ids)
        n = n_prompt + len(req.output_token_ids)
        if n > self.max_model_len:
            raise ExecutorError(
                f"request {req.req_id!r} has {n} tokens > max_model_len={self.max_model_len}"
            )
        self.token_ids[row, :n_prompt] = req.prompt_token_ids
        self.token_ids[row, n_prompt:n] = req.output_token_ids
        self._check_vocab(req.req_id, self.token_ids[row, :n])
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, req.block_ids, req.req_id)
        self._set_sampling(row, req.sampling_params, eos_token_ids)
        lora = getattr(req, "lora_request", None)
        self.lora_id[row] = lora.lora_int_id if lora is not None else 0
        self.req_ids.append(req.req_id)
        self.req_id_to_index[req.req_id] = row
        return row

    def _check_vocab(self, req_id: str, token_ids: np.ndarray) -> None:
        # an id outside the embedding would fail the forward pass, and with it every request
        if self.vocab_size is not None and len(token_ids):
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ExecutorError(
                    f"request {req_id!r} has token id {lo if lo < 0 else hi} outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )

    def _set_sampling(self, row: int, sp: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.has_seed[row] = sp.seed is not None
        self.seed[row] = sp.seed or 0
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.min_tokens[row] = sp.min_tokens
        stop_ids = list(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            stop_ids += [t for t in eos_token_ids if t not in stop_ids]
        self.min_tokens_stop_ids[row] = stop_ids if sp.min_tokens > 0 and stop_ids else None
        self.num_prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.constrained[row] = sp.constrains_tokens
        self.constraints[row] = sp if sp.constrains_tokens else None
        self.argmax_only[row] = sp.argmax_only

    def update_cached(
        self,
        req_id: str,
        new_token_ids: Sequence[int],
        new_block_ids: Sequence[int],
        num_computed_tokens: int,
    ) -> int:
        """Apply one CachedRequestData entry; return the row."""
        row = self.req_id_to_index.get(req_id)
        if row is None:
            raise BatchContractError(
                f"scheduled cached request {req_id!r} is not in the model runner's batch"
            )
        if new_token_ids:
            start = int(self.num_tokens[row])
            end = start + len(new_token_ids)
            if end > self.max_model_len:
                raise ExecutorError(
                    f"request {req_id!r} grew to {end} tokens > max_model_len={self.max_model_len}"
                )
            self.token_ids[row, start:end] = new_token_ids
            self.num_tokens[row] = end
        if new_block_ids:
            self._append_blocks(row, new_block_ids, req_id)
        self.num_computed_tokens[row] = num_computed_tokens
        return row

    def write_drafts(self, req_id: str, draft_token_ids: Sequence[int]) -> None:
        """Place draft tokens after the request's tokens, for this step only: they are not
        counted in ``num_tokens``, and the next step's new tokens overwrite them."""
        row = self.req_id_to_index.get(req_id)
        if row is None:
            raise BatchContractError(
                f"drafts for request {req_id!r}, which is not in the model runner's batch"
            )
        start = int(self.num_tokens[row])
        end = start + len(draft_token_ids)
        if end > self.max_model_len:
            raise ExecutorError(
                f"request {req_id!r}: {len(draft_token_ids)} drafts after {start} tokens "
                f"> max_model_len={self.max_model_len}"
            )
        self.token_ids[row, start:end] = draft_token_ids
        self._check_vocab(req_id, self.token_ids[row, start:end])

    def _append_blocks(self, row: int, block_ids: Sequence[int], req_id: str) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ExecutorError(
                f"request {req_id!r} has {end} blocks > {self.max_blocks_per_req} "
                f"(max_model_len / block_size)"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def remove_request(self, req_id: str) -> bool:
        """Drop a request; the last row moves into its place. False if it was not here."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return False
        last = self.num_reqs - 1
        if row != last:
            self._move_row(last, row)
        self.req_ids.pop()
        return True

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        self.req_ids[dst] = req_id
        self.req_id_to_index[req_id] = dst
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for arr in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.num_blocks,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.seed,
            self.has_seed,
            self.num_logprobs,
            self.min_tokens,
            self.num_prompt_logprobs,
            self.constrained,
            self.argmax_only,
            self.lora_id,
        ):
            arr[dst] = arr[src]
        self.min_tokens_stop_ids[dst] = self.min_tokens_stop_ids[src]
        self.min_tokens_stop_ids[src] = None
        self.constraints[dst] = self.constraints[src]
        self.constraints[src] = None

    # ------------------------------------------------------------------ views

    def output_token_ids(self, row: int, drafts: int = 0) -> np.ndarray:
        """The row's output tokens, and its first ``drafts`` draft tokens (``write_drafts``)."""
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row] + drafts]

    def all_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_tokens[row]]
