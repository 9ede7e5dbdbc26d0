"""Turn one SchedulerOutput plus the persistent batch into the step's tensors.

The scheduled tokens of all requests are flattened into one sequence: decode
tokens (one per request) first, sorted by context length so that decode groups
pad little, then the prefill chunks. A request verifying draft tokens
(speculative decoding) computes its last token and its drafts as that many
decode rows of growing context length over its own blocks (every row's K/V is
written before any row attends), so the decode kernels verify them; each of
those rows samples. Everything is computed with vectorised numpy over the batch
arrays and written into preallocated buffers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton.errors import ExecutorError
from baton.kernels.attention import AttentionMetadata, DecodeGroup, PrefillSeq
from baton.protocol import SchedulerOutput
from baton.worker.input_batch import InputBatch
from baton.worker.sampling_metadata import argmax_only

#: A decode group holds requests whose context is at least this fraction of the group's longest.
DECODE_GROUP_MIN_FILL = 0.5
#: ...unless fewer requests than this would be left for a new group.
DECODE_GROUP_MIN_SIZE = 4


@dataclass
class PromptRows:
    """Logits rows past the sampling ones that score prompt tokens (prompt_logprobs).

    Request ``req_ids[j]`` has ``counts[j]`` rows in a row: row p of its chunk scores the
    prompt token at position p + 1 (``targets``), with the top ``num_logprobs[j]``. A chunk
    of the last prompt token alone has none (that step hands back the earlier chunks').
    """

    req_ids: list[str]
    counts: list[int]
    num_logprobs: list[int]
    targets: np.ndarray  # [P] int64


@dataclass
class StepInputs:
    """The tensors and bookkeeping of one step."""

    input_ids: torch.Tensor  # [T] on the device
    positions: torch.Tensor  # [T] on the device
    logits_indices: torch.Tensor  # [S] on the device: flattened positions that sample
    attn: AttentionMetadata
    req_ids: list[str]  # scheduled requests, in the scheduler's order
    sample_req_ids: list[str]  # requests that sample, aligned with logits rows
    sample_rows: np.ndarray  # their batch rows
    flat_req_ids: list[str]  # scheduled requests in flattened order (a verifying one per row)
    query_start: np.ndarray  # [n] where each of them starts in the flattened sequence
    #: per sampling row: its position after the request's computed tokens (0 but for drafts:
    #: row j of a request verifying drafts samples the token after its j-th draft)
    sample_offsets: np.ndarray | None = None
    #: the decode rows of one request attend to K/V written by each other this step
    rows_share_context: bool = False
    #: the drafts verified this step: req id -> draft tokens (SchedulerOutput's)
    drafts: dict[str, list[int]] | None = None
    #: prompt tokens scored this step; their logits rows follow the sampling rows
    prompt_rows: PromptRows | None = None
    #: [T] the LoRA adapter id of each token (0: none); None when no token has one
    lora_ids: np.ndarray | None = None
    #: [T, blocks] int64 each token's request's blocks (batch-invariant steps: every token is a
    #: row of the native layer stack); None where the builder's token_tables leaves it out
    token_blocks: torch.Tensor | None = None
    #: the sampler reads only each sampling row's argmax (``argmax_only``): the forward may give
    #: -inf where a logit cannot be its row's largest
    argmax_only: bool = False

    @property
    def num_sample_rows(self) -> int:
        return len(self.sample_req_ids)


@dataclass
class _Scheduled:
    """The requests a step computes, aligned: batch rows and token ranges."""

    req_ids: list[str]  # in the scheduler's order
    rows: np.ndarray  # their batch rows
    q_lens: np.ndarray  # tokens scheduled
    start: np.ndarray  # computed tokens before the step
    end: np.ndarray  # start + q_lens
    num_tokens: np.ndarray  # tokens the request has (prompt and output)
    n_drafts: np.ndarray | None  # drafts verified; None when the step verifies none


@dataclass
class _Segments:
    """The step's flattened segments: decode rows (longest context first), then prefill chunks."""

    order: np.ndarray  # segment -> index into the scheduled requests
    rows: np.ndarray  # its batch row
    q: np.ndarray  # its tokens
    start: np.ndarray  # its first position
    end: np.ndarray  # one past its last position
    offsets: np.ndarray | None  # its position past the request's computed tokens (drafts)
    cu: np.ndarray  # cumulative tokens
    q_start: np.ndarray  # where it starts in the flattened sequence
    nd: int  # decode rows (the first nd segments)
    num_decodes: int  # requests that decode (fewer than nd when one verifies drafts)


class StepInputBuilder:
    """Builds StepInputs; owns the staging buffers sized by max_num_batched_tokens."""

    def __init__(
        self,
        batch: InputBatch,
        max_num_tokens: int,
        device: torch.device,
        kernels: bool = False,
        token_tables: int = 0,
        token_table_keys: int | None = None,
    ) -> None:
        self.batch = batch
        self.device = device
        #: attention runs through the C++ kernels: one decode group (they read no padding)
        self.kernels = kernels
        #: build StepInputs.token_blocks for steps of at most this many tokens (0: never; every
        #: step in batch-invariant mode, prefill and mixed steps the native stack runs otherwise)
        self.token_tables = int(token_tables)
        #: ... and whose prompt rows attend over at most this many keys each on average (None:
        #: any; decode rows read their whole context whichever path runs them)
        self.token_table_keys = token_table_keys
        self.max_num_tokens = max_num_tokens
        pin = device.type == "cuda"
        # CPU staging buffers; on CPU they are the step tensors themselves (sliced).
        self._ids = torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin)
        self._pos = torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin)
        self._slots = torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin)
        self._ids_np, self._pos_np, self._slots_np = (
            self._ids.numpy(),
            self._pos.numpy(),
            self._slots.numpy(),
        )
        self._arange = np.arange(max(max_num_tokens, batch.max_model_len) + 1, dtype=np.int64)
        self._kv_caches: list[torch.Tensor | None] | None = None
        self._attn_out: torch.Tensor | None = None

    def set_kv_caches(
        self, kv_caches: list[torch.Tensor | None], attn_out: torch.Tensor | None = None
    ) -> None:
        """The paged caches, and a buffer of max_num_tokens * heads * head_dim for attention outputs."""
        self._kv_caches = kv_caches
        self._attn_out = attn_out

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def build(self, so: SchedulerOutput, skip: Collection[str] = ()) -> StepInputs:
        """The inputs of the scheduled requests, less those in ``skip`` (they failed to prepare)."""
        b = self.batch
        sch = self._scheduled(so, skip)
        seg = self._segments(sch)
        total = int(sch.q_lens.sum())
        positions, token_rows = self._flatten(seg, total)
        lora_ids = b.lora_id[token_rows] if b.lora_id[sch.rows].any() else None
        token_blocks = None
        if total <= self.token_tables and self._prompt_keys_fit(seg):
            # blocks up to the step's longest context, per token
            nb = int(positions.max()) // b.block_size + 1
            token_blocks = self._to_device(torch.from_numpy(b.block_table[token_rows, :nb]))
        samples = seg.end >= sch.num_tokens[seg.order]  # the last token, or a verifying row
        sample_idx = np.nonzero(samples)[0]
        flat = seg.cu[sample_idx] - 1
        req_ids = sch.req_ids
        prompt_rows = self._prompt_rows(
            req_ids, seg.order, seg.rows, seg.start, seg.end, seg.q_start
        )
        if prompt_rows is not None:
            flat = np.concatenate([flat, prompt_rows[1]])
        attn = AttentionMetadata(
            kv_caches=self._kv_caches,
            slot_mapping=self._to_device(self._slots[:total]),
            block_size=b.block_size,
            decode_groups=self._decode_groups(seg.rows[: seg.nd], seg.end[: seg.nd]),
            prefills=self._prefills(seg),
            num_tokens=total,
            out=self._attn_out,
            kernels=self.kernels,
        )
        return StepInputs(
            input_ids=self._to_device(self._ids[:total]),
            positions=self._to_device(self._pos[:total]),
            logits_indices=self._to_device(torch.from_numpy(flat)),
            attn=attn,
            req_ids=req_ids,
            sample_req_ids=[req_ids[j] for j in seg.order[sample_idx]],
            sample_rows=seg.rows[sample_idx],
            flat_req_ids=[req_ids[j] for j in seg.order],
            query_start=seg.q_start,
            sample_offsets=seg.offsets[sample_idx] if seg.offsets is not None else None,
            drafts=so.scheduled_spec_decode_tokens or None,
            rows_share_context=seg.nd > seg.num_decodes,
            prompt_rows=prompt_rows[0] if prompt_rows is not None else None,
            lora_ids=lora_ids,
            token_blocks=token_blocks,
            argmax_only=prompt_rows is None
            and not so.structured_output_req_ids
            and argmax_only(b, seg.rows[sample_idx]),
        )

    def advance(self, prev: StepInputs, tokens: Sequence[int]) -> StepInputs:
        """The decode step after ``prev``, a step of decodes alone in which every request
        sampled: each request's entry of ``tokens`` (aligned with ``prev.sample_req_ids``) at
        the position after its last, in the blocks the batch holds (``decode_steps``). It
        rewrites the staging buffers that ``prev``'s tensors view on CPU."""
        b, bs = self.batch, self.batch.block_size
        n = prev.num_sample_rows
        rows = prev.sample_rows
        pos = self._pos_np[:n]
        pos += 1
        self._ids_np[:n] = tokens
        np.add(b.block_table[rows, pos // bs] * bs, pos % bs, out=self._slots_np[:n])
        token_blocks = None
        if prev.token_blocks is not None:  # blocks up to the step's longest context, per token
            nb = int(pos.max()) // bs + 1
            token_blocks = self._to_device(torch.from_numpy(b.block_table[rows, :nb]))
        attn = dataclasses.replace(
            prev.attn,
            slot_mapping=self._to_device(self._slots[:n]),
            decode_groups=self._decode_groups(rows, pos + 1),
        )
        return dataclasses.replace(
            prev,
            input_ids=self._to_device(self._ids[:n]),
            positions=self._to_device(self._pos[:n]),
            attn=attn,
            token_blocks=token_blocks,
        )

    def _scheduled(self, so: SchedulerOutput, skip: Collection[str]) -> _Scheduled:
        """The scheduled requests' batch rows and token ranges, checked against the batch."""
        b = self.batch
        scheduled = so.num_scheduled_tokens
        if skip:
            scheduled = {r: q for r, q in scheduled.items() if r not in skip}
        req_ids = list(scheduled)
        n = len(req_ids)
        try:
            rows = np.fromiter((b.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=n)
        except KeyError as e:
            raise ExecutorError(
                f"scheduled request {e.args[0]!r} is not in the model runner's batch"
            ) from None
        q_lens = np.fromiter(scheduled.values(), dtype=np.int64, count=n)
        start = b.num_computed_tokens[rows]
        end = start + q_lens
        num_tokens = b.num_tokens[rows]
        spec = so.scheduled_spec_decode_tokens
        n_drafts = (
            np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=n)
            if spec
            else None
        )
        avail = num_tokens if n_drafts is None else num_tokens + n_drafts
        bad_q = (q_lens <= 0) | (end > avail)
        if n_drafts is not None:  # a verifying request computes its last token and its drafts
            bad_q |= (n_drafts > 0) & (start != num_tokens - 1)
        if bad_q.any():
            bad = int(np.nonzero(bad_q)[0][0])
            raise ExecutorError(
                f"request {req_ids[bad]!r}: {int(q_lens[bad])} tokens scheduled from position {int(start[bad])} "
                f"but it has {int(num_tokens[bad])} tokens"
                + (f" and {int(n_drafts[bad])} drafts" if n_drafts is not None else "")
            )
        total = int(q_lens.sum())
        if total > self.max_num_tokens:
            raise ExecutorError(
                f"{total} tokens scheduled > max_num_batched_tokens={self.max_num_tokens}"
            )
        return _Scheduled(req_ids, rows, q_lens, start, end, num_tokens, n_drafts)

    def _segments(self, sch: _Scheduled) -> _Segments:
        """One segment per decode row (a verifying request gives one per token), longest
        context first, then one per prefill chunk."""
        q_lens, start, end, n_drafts = sch.q_lens, sch.start, sch.end, sch.n_drafts
        is_dec = q_lens == 1
        if n_drafts is not None:
            is_dec |= n_drafts > 0
        dec = np.nonzero(is_dec)[0]
        pre = np.nonzero(~is_dec)[0]
        if n_drafts is None:  # one row per decode
            seg_req = dec[np.argsort(-end[dec], kind="stable")]
            order = np.concatenate([seg_req, pre])
            q_o, start_o, end_o = q_lens[order], start[order], end[order]
            off_o = None
        else:
            seg_req = np.repeat(dec, q_lens[dec])
            first = np.repeat(np.cumsum(q_lens[dec]) - q_lens[dec], q_lens[dec])
            seg_off = self._arange[: len(seg_req)] - first
            seg_end = start[seg_req] + seg_off + 1
            by_len = np.argsort(-seg_end, kind="stable")
            seg_req, seg_off, seg_end = seg_req[by_len], seg_off[by_len], seg_end[by_len]
            order = np.concatenate([seg_req, pre])
            q_o = np.concatenate([np.ones(len(seg_req), dtype=np.int64), q_lens[pre]])
            end_o = np.concatenate([seg_end, end[pre]])
            start_o = end_o - q_o
            off_o = np.concatenate([seg_off, np.zeros(len(pre), dtype=np.int64)])
        cu = np.cumsum(q_o)
        return _Segments(
            order=order,
            rows=sch.rows[order],
            q=q_o,
            start=start_o,
            end=end_o,
            offsets=off_o,
            cu=cu,
            q_start=cu - q_o,
            nd=len(seg_req),
            num_decodes=len(dec),
        )

    def _prompt_keys_fit(self, seg: _Segments) -> bool:
        """Whether the step's prompt rows attend over at most token_table_keys keys on average
        (a chunk's rows at positions start .. end - 1 read start + 1 .. end keys)."""
        if self.token_table_keys is None:
            return True
        q, start, end = seg.q[seg.nd :], seg.start[seg.nd :], seg.end[seg.nd :]
        keys = int((q * (start + end + 1)).sum()) // 2
        return keys <= self.token_table_keys * int(q.sum())

    def _flatten(self, seg: _Segments, total: int) -> tuple[np.ndarray, np.ndarray]:
        """Write the step's token ids, positions and KV slots into the staging buffers; return
        each token's position and batch row."""
        b = self.batch
        bs = b.block_size
        tok_seg = np.repeat(self._arange[: len(seg.order)], seg.q)
        positions = self._pos_np[:total]
        np.add(np.repeat(seg.start - seg.q_start, seg.q), self._arange[:total], out=positions)
        token_rows = seg.rows[tok_seg]
        np.take(
            b.token_ids.reshape(-1),
            token_rows * b.max_model_len + positions,
            out=self._ids_np[:total],
        )
        blocks = b.block_table[token_rows, positions // bs]
        np.add(blocks * bs, positions % bs, out=self._slots_np[:total])
        return positions, token_rows

    def _prefills(self, seg: _Segments) -> list[PrefillSeq]:
        """The prefill chunks (the segments after the decode rows), with their cached blocks."""
        b, bs = self.batch, self.batch.block_size
        prefills = []
        for i in range(seg.nd, len(seg.order)):
            p_len = int(seg.start[i])
            blocks = None
            if p_len > 0:
                nb = -(-int(seg.end[i]) // bs)
                blocks = self._to_device(torch.from_numpy(b.block_table[seg.rows[i], :nb].copy()))
            prefills.append(PrefillSeq(int(seg.q_start[i]), int(seg.q[i]), p_len, blocks))
        return prefills

    def _prompt_rows(
        self,
        req_ids: list[str],
        order: np.ndarray,
        rows_o: np.ndarray,
        start_o: np.ndarray,
        end_o: np.ndarray,
        q_start: np.ndarray,
    ) -> tuple[PromptRows, np.ndarray] | None:
        """The prompt positions this step scores, and their flattened indices: each segment of
        a request that wants prompt_logprobs and has no output yet (a resumed request with
        output sent them before), over its positions up to the prompt's second-to-last."""
        b = self.batch
        want = (b.num_prompt_logprobs[rows_o] >= 0) & (
            b.num_tokens[rows_o] == b.num_prompt_tokens[rows_o]
        )
        if not want.any():
            return None
        ids, counts, ks, flats, targets = [], [], [], [], []
        for i in np.nonzero(want)[0].tolist():
            row = int(rows_o[i])
            lo, hi = int(start_o[i]), min(int(end_o[i]), int(b.num_prompt_tokens[row]) - 1)
            # a last chunk of the last prompt token alone scores nothing, but it is listed
            # (with no rows): the step that samples hands back the earlier chunks' scores
            hi = max(hi, lo)
            ids.append(req_ids[int(order[i])])
            counts.append(hi - lo)
            ks.append(int(b.num_prompt_logprobs[row]))
            flats.append(int(q_start[i]) + self._arange[: hi - lo])
            targets.append(b.token_ids[row, lo + 1 : hi + 1])
        rows = PromptRows(ids, counts, ks, np.concatenate(targets))
        return rows, np.concatenate(flats)

    def _decode_groups(self, rows: np.ndarray, ctx: np.ndarray) -> list[DecodeGroup]:
        """Split decodes (sorted by context length, descending) into groups of similar length."""
        b, bs = self.batch, self.batch.block_size
        groups = []
        i, nd = 0, len(rows)
        while i < nd:
            longest = int(ctx[i])
            j = i + 1
            while j < nd and (
                self.kernels
                or ctx[j] >= DECODE_GROUP_MIN_FILL * longest
                or nd - j < DECODE_GROUP_MIN_SIZE
            ):
                j += 1
            nb = -(-longest // bs)
            # each request's blocks, padded with its own last block (masked out, always finite)
            last = (ctx[i:j] - 1) // bs
            idx = np.minimum(self._arange[:nb][None, :], last[:, None])
            blocks = b.block_table[rows[i:j, None], idx]
            groups.append(
                DecodeGroup(
                    start=i,
                    n=j - i,
                    max_len=nb * bs,
                    blocks=self._to_device(torch.from_numpy(blocks.reshape(-1))),
                    ctx_lens=self._to_device(torch.from_numpy(ctx[i:j].copy())),
                )
            )
            i = j
        return groups
