"""Pooling in the model runner: a pooling request's prompt hidden states -> one vector.

A pooling request (``NewRequestData.pooling_params``) is prefilled like any
other, in the same steps (chunked, batched with decodes and other prompts),
but never samples: its rows leave the step's sampling rows, and the final
hidden states (the output of the model's base module, after its final norm)
of its tokens are captured by a forward hook while the step runs. ``last``
keeps the last prompt token's, ``cls`` the first's, ``mean`` a running float32
sum over every chunk (token by token with executor.batch_invariant). After the
chunk that ends its prompt, the vector
(optionally cut to ``dimensions``, then L2-normalised) goes back in
``ModelRunnerOutput.pooler_output`` and the scheduler finishes the request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from baton.errors import ExecutorError
from baton.pooling_params import PoolingParams, with_defaults
from baton.protocol import SchedulerOutput
from baton.worker.input_batch import InputBatch
from baton.worker.step_inputs import StepInputs


@dataclass
class _State:
    """What one pooling request has gathered so far."""

    params: PoolingParams
    next_pos: int = 0  # the position whose hidden state comes next (mean, cls)
    total: torch.Tensor | None = None  # the float32 sum so far (mean)
    first: torch.Tensor | None = None  # the first token's hidden state (cls)


@dataclass
class Span:
    """One pooling request's tokens in a step: ``length`` tokens from flattened index
    ``flat_start``, prompt positions ``start .. start + length``, of ``num_prompt``."""

    req_id: str
    flat_start: int
    length: int
    start: int
    num_prompt: int


class Pooler:
    """The runner's pooling requests and their partial results."""

    def __init__(self, pooling_type: str, normalize: bool, invariant: bool = False) -> None:
        self.pooling_type = pooling_type
        self.normalize = normalize
        #: executor.batch_invariant: mean pooling adds the tokens one by one, in prompt order, so
        #: that its sum does not depend on where the prompt's chunks end
        self.invariant = invariant
        self.requests: dict[str, _State] = {}
        #: the hidden states captured by the running step's hook ([tokens, hidden])
        self._hidden: torch.Tensor | None = None
        self.capturing = False

    def update(self, so: SchedulerOutput) -> None:
        """Forget finished and preempted requests; start (or restart) the new ones."""
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(rid, None)
        for req in so.scheduled_new_reqs:
            self.requests.pop(req.req_id, None)
            if req.pooling_params is not None:
                params = with_defaults(req.pooling_params, self.pooling_type, self.normalize)
                self.requests[req.req_id] = _State(params)

    def plan(self, inputs: StepInputs, batch: InputBatch) -> tuple[StepInputs, list[Span]]:
        """The step's pooling spans, and ``inputs`` without their sampling rows."""
        if not self.requests:
            return inputs, []
        pooling = [rid for rid in inputs.req_ids if rid in self.requests]
        if not pooling:
            return inputs, []
        where = {rid: i for i, rid in enumerate(inputs.flat_req_ids)}
        ends = np.append(inputs.query_start[1:], int(inputs.input_ids.shape[0]))
        spans = []
        for rid in pooling:
            i = where[rid]
            row = batch.req_id_to_index[rid]
            start = int(inputs.query_start[i])
            spans.append(
                Span(
                    rid,
                    start,
                    int(ends[i]) - start,
                    int(batch.num_computed_tokens[row]),
                    int(batch.num_prompt_tokens[row]),
                )
            )
        keep = [i for i, rid in enumerate(inputs.sample_req_ids) if rid not in self.requests]
        if len(keep) == len(inputs.sample_req_ids):
            return inputs, spans
        idx = np.asarray(keep, dtype=np.int64)
        # logits rows past the sampling ones (if any: prompt scoring) stay as they are
        n, total = len(inputs.sample_req_ids), int(inputs.logits_indices.shape[0])
        rows = torch.from_numpy(np.concatenate([idx, np.arange(n, total, dtype=np.int64)]))
        offsets = inputs.sample_offsets
        inputs = dataclasses.replace(
            inputs,
            logits_indices=inputs.logits_indices[rows.to(inputs.logits_indices.device)],
            sample_req_ids=[inputs.sample_req_ids[i] for i in keep],
            sample_rows=inputs.sample_rows[idx],
            sample_offsets=offsets[idx] if offsets is not None else None,
        )
        return inputs, spans

    @contextmanager
    def capture(self, model: torch.nn.Module, spans: list[Span]) -> Iterator[None]:
        """Record the final hidden states of the forward run inside (only when ``spans``)."""
        if not spans:
            yield
            return
        base = getattr(model, "base_model", model)

        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            self._hidden = hidden[0] if hidden.dim() == 3 else hidden

        handle = base.register_forward_hook(hook)
        self.capturing = True
        self._hidden = None
        try:
            yield
        finally:
            handle.remove()
            self.capturing = False

    def captured(self, hidden: torch.Tensor) -> None:
        """The step's final hidden states [tokens, hidden] computed without the model's modules
        (batch-invariant steps), in place of what the capture hook records."""
        if self.capturing:
            self._hidden = hidden

    def pool(self, spans: list[Span]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Add the captured hidden states to each span's request; the vectors of those whose
        prompt ended this step, and the requests that failed (-> "ExceptionType: message")."""
        hidden, self._hidden = self._hidden, None
        done: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        if not spans:
            return done, failed
        if hidden is None:
            raise ExecutorError(
                "a step with pooling requests captured no hidden states: the model's base "
                "module did not run (a model or runner that skips it cannot pool)"
            )
        for span in spans:
            try:
                vec = self._add(span, hidden[span.flat_start : span.flat_start + span.length])
            except ExecutorError as e:
                failed[span.req_id] = f"{type(e).__name__}: {e}"
                self.requests.pop(span.req_id, None)
                continue
            if vec is not None:
                done[span.req_id] = vec
                self.requests.pop(span.req_id, None)
        return done, failed

    def _add(self, span: Span, h: torch.Tensor) -> torch.Tensor | None:
        """Fold one span into its request; its vector when the span ends the prompt."""
        st = self.requests[span.req_id]
        kind = st.params.pooling_type
        if kind != "last":
            if span.start != st.next_pos:
                raise ExecutorError(
                    f"{kind} pooling of request {span.req_id!r} needs every prompt token, but "
                    f"its chunk starts at position {span.start} after {st.next_pos} "
                    "(a prefix-cache hit must not be read for it)"
                )
            st.next_pos = span.start + span.length
            if kind == "mean" and self.invariant:
                for row in h.float():
                    st.total = row.clone() if st.total is None else st.total + row
            elif kind == "mean":
                part = h.float().sum(0)
                st.total = part if st.total is None else st.total + part
            elif st.first is None:
                st.first = h[0].float()
        if span.start + span.length < span.num_prompt:
            return None
        if kind == "mean":
            assert st.total is not None
            vec = st.total / span.num_prompt
        elif kind == "cls":
            assert st.first is not None
            vec = st.first
        else:
            vec = h[-1].float()
        if st.params.dimensions is not None:
            vec = vec[: st.params.dimensions]
        if st.params.normalize:
            vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
        return vec.cpu().contiguous()
