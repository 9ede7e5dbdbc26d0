"""Turn EngineCoreOutputs into RequestOutputs: detokenise, stop strings, logprobs, n > 1, stats."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from baton.frontend.detokenizer import IncrementalDetokenizer
from baton.metrics.stats import FinishedRequestStats, IterationStats, RequestMetrics
from baton.metrics.tracing import RequestTrace, RequestTracer, pick_trace_headers
from baton.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from baton.protocol import EngineCoreEventType, EngineCoreOutput, FinishReason, TokenLogprobs
from baton.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


class ParentRequest:
    """Joins the n child sequences of one user request (each child is its own engine request)."""

    def __init__(self, request_id: str, n: int, kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.kind = kind
        self.children: list[CompletionOutput | None] = [None] * n
        self.unfinished = n
        #: The first child's error ("ExceptionType: message"), reported on every later joined output.
        self.error: str | None = None

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def merge(self, child: CompletionOutput) -> list[CompletionOutput] | None:
        """The outputs to report after a child update, or None to report nothing yet."""
        before = self.children[child.index]
        self.children[child.index] = child
        if child.finished and not (before is not None and before.finished):
            self.unfinished -= 1  # once per child, also when a failed child reports again
        if self.kind == RequestOutputKind.DELTA:
            return [child]
        if self.kind == RequestOutputKind.FINAL_ONLY and self.unfinished:
            return None
        return [c for c in self.children if c is not None]


def split_request(
    request_id: str, params: SamplingParams
) -> list[tuple[str, int, SamplingParams, ParentRequest | None]]:
    """(engine request id, index, params, parent) per sequence: n > 1 becomes n child requests."""
    if params.n == 1:
        return [(request_id, 0, params, None)]
    parent = ParentRequest(request_id, params.n, params.output_kind)
    # each child samples independently; seeded children stay reproducible
    return [
        (
            parent.child_id(i),
            i,
            params.clone(n=1, seed=None if params.seed is None else params.seed + i),
            parent,
        )
        for i in range(params.n)
    ]


@dataclass(slots=True)
class RequestState:
    request_id: str  # the engine request id (a child id when n > 1)
    index: int
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    user: str | None = None
    token_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0
    logprobs: SampleLogprobs | None = None
    sent_logprobs: int = 0
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    sent_prompt_logprobs: bool = False
    #: Called with each RequestOutput (AsyncLLM's per-request queue); None: returned in a list.
    sink: Callable[[Any], None] | None = None
    #: A pooling request: one PoolingRequestOutput when it finishes, no tokens.
    pooling: bool = False
    #: Its span's parent (``RequestTracer.parent``, taken when it arrived); tracing on only.
    trace_parent: Any = None


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    #: Requests the engine still runs but the frontend finished (stop strings): abort them.
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(
        self, tokenizer: Any, log_stats: bool = True, tracer: RequestTracer | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        #: Told of every request that finishes (a span each); None: tracing is off.
        self.tracer = tracer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        index: int = 0,
        parent: ParentRequest | None = None,
        user: str | None = None,
        sink: Callable[[Any], None] | None = None,
        detokenize: bool = True,
        pooling: bool = False,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Track a request; ``pooling``: a pooling request (``params`` are the engine's
        placeholder), answered by one PoolingRequestOutput; ``trace_headers``: the caller's
        (traceparent) for its span's parent, when tracing is on."""
        detok = (
            IncrementalDetokenizer(self.tokenizer, params) if detokenize and not pooling else None
        )
        self.states[request_id] = RequestState(
            request_id,
            index,
            parent,
            prompt,
            prompt_token_ids,
            params,
            detok,
            RequestMetrics(arrival_time=arrival_time),
            user,
            sink=sink,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            pooling=pooling,
            trace_parent=(
                self.tracer.parent(pick_trace_headers(trace_headers))
                if self.tracer is not None
                else None
            ),
        )
        if parent is not None:
            self.parents[parent.request_id] = parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def num_unfinished_requests(self) -> int:
        return len(self.states)

    def abort_requests(
        self, request_ids: Iterable[str], iteration_stats: IterationStats | None = None
    ) -> list[str]:
        """Forget requests (user aborts); returns the engine request ids to abort (children included).

        With ``iteration_stats``, each live request aborted here is counted as a finished
        request with finish reason ``abort`` (so the stat loggers see client aborts).
        """
        engine_ids = []
        now = time.monotonic()
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            ids = [parent.child_id(i) for i in range(len(parent.children))] if parent else [rid]
            for eid in ids:
                state = self.states.pop(eid, None)
                if state is not None:
                    engine_ids.append(eid)
                    self._trace(state, FinishReason.ABORT, None, now)
                    if iteration_stats is not None:
                        state.metrics.finished_time = now
                        iteration_stats.finished_requests.append(
                            self._finished_stats(state, FinishReason.ABORT)
                        )
        return engine_ids

    def is_live(self, request_id: str) -> bool:
        """Whether a user request id (or a child of it) is still being served."""
        return request_id in self.states or request_id in self.parents

    def process_outputs(
        self, outputs: Iterable[EngineCoreOutput], iteration_stats: IterationStats | None = None
    ) -> ProcessedOutputs:
        """RequestOutputs for a batch of engine outputs. A request whose output fails to process
        (detokenisation, logprobs, stop strings) finishes with an error and is aborted in the
        engine; the others in the batch are processed as usual."""
        now = time.monotonic()
        result: list[RequestOutput | PoolingRequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted by the user meanwhile
            try:
                ro = self._process_one(state, out, now, iteration_stats, to_abort)
            except Exception as e:
                ro = self._fail_one(state, out, e, iteration_stats, to_abort)
            if ro is None:
                continue
            if state.sink is not None:
                state.sink(ro)
            else:
                result.append(ro)
        return ProcessedOutputs(result, to_abort)

    def _process_one(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        now: float,
        iteration_stats: IterationStats | None,
        to_abort: list[str],
    ) -> RequestOutput | PoolingRequestOutput | None:
        if state.pooling:
            return self._pooled(state, out, now, iteration_stats)
        finish_reason = out.finish_reason
        stop_reason = out.stop_reason
        new = out.new_token_ids
        if state.params.prompt_logprobs is not None and state.prompt_logprobs is None:
            if out.new_prompt_logprobs is not None:
                state.prompt_logprobs = [None, *map(self._position, out.new_prompt_logprobs)]
            elif new and len(state.prompt_token_ids) == 1:
                state.prompt_logprobs = [None]  # nothing to score
        stopped = state.detokenizer is not None and bool(new) and state.detokenizer.update(new)
        if stopped:  # tokens past the stop string (several came at once) are not the output's
            new = new[: state.detokenizer.num_kept]  # type: ignore[union-attr]
        if new:
            state.token_ids.extend(new)
            if out.new_logprobs is not None and state.logprobs is not None:
                self._add_logprobs(state, out.new_logprobs[: len(new)])
        if stopped:
            if finish_reason is None:  # the engine still runs it
                to_abort.append(out.request_id)
            finish_reason, stop_reason = FinishReason.STOP, state.detokenizer.stop_reason  # type: ignore[union-attr]
        self._update_metrics(state, out, len(new), now, iteration_stats)
        finished = finish_reason is not None
        if finished:
            del self.states[out.request_id]
            self._trace(state, finish_reason, out.error, now)
            if iteration_stats is not None:
                iteration_stats.finished_requests.append(self._finished_stats(state, finish_reason))
        return self._make_output(state, finish_reason, stop_reason, out, finished)

    def _fail_one(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        error: Exception,
        iteration_stats: IterationStats | None,
        to_abort: list[str],
    ) -> RequestOutput | PoolingRequestOutput | None:
        """Finish a request whose output raised: an error output; the engine drops it."""
        rid = out.request_id
        message = f"{type(error).__name__}: {error}"
        log.warning("request %s failed in the output processor: %s", rid, message)
        log.debug("request %s: traceback", rid, exc_info=error)
        if out.finish_reason is None and rid not in to_abort:
            to_abort.append(rid)
        if self.states.pop(rid, None) is not None:
            now = time.monotonic()
            self._trace(state, FinishReason.ERROR, message, now)
            if iteration_stats is not None:
                state.metrics.finished_time = now
                iteration_stats.finished_requests.append(
                    self._finished_stats(state, FinishReason.ERROR)
                )
        if state.pooling:
            return self._pooling_output(state, out, None, message)
        kind = state.params.output_kind
        token_ids = (
            state.token_ids[state.sent_tokens :]
            if kind == RequestOutputKind.DELTA
            else list(state.token_ids)
        )
        state.sent_tokens = len(state.token_ids)
        completion = CompletionOutput(
            index=state.index,
            text="",
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None,
            finish_reason=str(FinishReason.ERROR),
            stop_reason=None,
        )
        return self._request_output(state, completion, True, out, message)

    def _pooled(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        now: float,
        iteration_stats: IterationStats | None,
    ) -> PoolingRequestOutput | None:
        """A pooling request's output: its vector once it finished, nothing before."""
        self._update_metrics(state, out, len(out.new_token_ids), now, iteration_stats)
        if out.finish_reason is None:
            return None
        del self.states[out.request_id]
        self._trace(state, out.finish_reason, out.error, now)
        if iteration_stats is not None:
            iteration_stats.num_prompt_tokens += len(state.prompt_token_ids)
            iteration_stats.finished_requests.append(self._finished_stats(state, out.finish_reason))
        data = out.pooling_output
        return self._pooling_output(
            state, out, PoolingOutput(data) if data is not None else None, out.error
        )

    def _pooling_output(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        pooled: PoolingOutput | None,
        error: str | None,
    ) -> PoolingRequestOutput:
        return PoolingRequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=pooled,
            finished=True,
            num_cached_tokens=out.num_cached_tokens,
            metrics=state.metrics,
            error=error,
            user=state.user,
        )

    # ------------------------------------------------------------------ helpers

    def _add_logprobs(self, state: RequestState, entries: list[TokenLogprobs]) -> None:
        assert state.logprobs is not None and state.cumulative_logprob is not None
        for e in entries:
            state.logprobs.append(self._position(e))
            state.cumulative_logprob += e.logprobs[0]

    def _position(self, e: TokenLogprobs) -> dict[int, Logprob]:
        """One position's candidates: its token (with its rank), then the top-k."""
        decode = self.tokenizer.decode
        pos: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(e.token_ids, e.logprobs, strict=True)):
            if tid not in pos:
                rank = e.sampled_rank if j == 0 else j
                pos[tid] = Logprob(lp, rank, decode([tid]))
        return pos

    def _update_metrics(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        n_new: int,
        now: float,
        stats: IterationStats | None,
    ) -> None:
        """Events, TTFT / ITL and token counts of ``out``, of which ``n_new`` tokens are kept."""
        m = state.metrics
        for ev in out.events or ():
            if ev.type == EngineCoreEventType.QUEUED:
                m.queued_time = ev.timestamp
            elif ev.type == EngineCoreEventType.SCHEDULED and m.first_scheduled_time is None:
                m.first_scheduled_time = ev.timestamp
            elif ev.type == EngineCoreEventType.PREEMPTED:
                m.num_preemptions += 1
                if stats is not None:
                    stats.num_preemptions += 1
        if n_new:
            if m.first_token_time is None:
                m.first_token_time = now
                if stats is not None:
                    stats.num_prompt_tokens += len(state.prompt_token_ids)
                    stats.time_to_first_tokens.append(now - m.arrival_time)
            elif stats is not None and m.last_token_time is not None:
                stats.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
            m.num_generation_tokens += n_new
            if stats is not None:
                stats.num_generation_tokens += n_new
        if out.finish_reason is not None or (
            state.detokenizer is not None and state.detokenizer.stop_reason
        ):
            m.finished_time = now

    def fail_unfinished(self, error: BaseException) -> list[RequestState]:
        """Forget every request (a dead or stopped engine): their states, each traced as failed
        with ``error``; the caller tells their consumers."""
        states = list(self.states.values())
        now = time.monotonic()
        message = f"{type(error).__name__}: {error}"
        for state in states:
            self._trace(state, FinishReason.ERROR, message, now)
        self.states.clear()
        self.parents.clear()
        return states

    def _trace(
        self, state: RequestState, reason: FinishReason | str, error: str | None, now: float
    ) -> None:
        """Tell the tracer (if any) that ``state``'s request finished; a tracer that fails is
        logged, never the request's failure."""
        if self.tracer is None:
            return
        m, p, parent = state.metrics, state.params, state.parent
        trace = RequestTrace(
            request_id=parent.request_id if parent is not None else state.request_id,
            index=state.index,
            finish_reason=str(reason),
            error=error,
            prompt_tokens=len(state.prompt_token_ids),
            completion_tokens=m.num_generation_tokens,
            max_tokens=None if state.pooling else p.max_tokens,
            temperature=None if state.pooling else p.temperature,
            top_p=None if state.pooling else p.top_p,
            n=len(parent.children) if parent is not None else 1,
            num_preemptions=m.num_preemptions,
            arrival_time=m.arrival_time,
            queued_time=m.queued_time,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time,
            last_token_time=m.last_token_time,
            finished_time=m.finished_time if m.finished_time is not None else now,
            parent=state.trace_parent,
        )
        try:
            self.tracer.finished(trace)
        except Exception:  # tracing must not fail a finished request
            log.exception("request %s: the tracer failed", state.request_id)

    def _finished_stats(self, state: RequestState, reason: FinishReason) -> FinishedRequestStats:
        m = state.metrics
        return FinishedRequestStats(
            finish_reason=str(reason),
            e2e_latency=(m.finished_time or time.monotonic()) - m.arrival_time,
            queue_time=m.queue_time or 0.0,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=m.num_generation_tokens,
            ttft=m.ttft,
            num_preemptions=m.num_preemptions,
        )

    def _make_output(
        self,
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        out: EngineCoreOutput,
        finished: bool,
    ) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished and state.parent is None:
            return None
        detok = state.detokenizer
        if kind == RequestOutputKind.DELTA:
            text = detok.take_delta(finished) if detok else ""
            token_ids = state.token_ids[state.sent_tokens :]
            logprobs = state.logprobs[state.sent_logprobs :] if state.logprobs is not None else None
            state.sent_tokens = len(state.token_ids)
            state.sent_logprobs = len(state.logprobs or ())
            if not text and not token_ids and not finished:
                return None
        else:
            text = detok.visible_text(finished) if detok else ""
            token_ids = list(state.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finish_reason is not None else None,
            stop_reason=stop_reason,
        )
        return self._request_output(state, completion, finished, out, out.error)

    def _request_output(
        self,
        state: RequestState,
        completion: CompletionOutput,
        finished: bool,
        out: EngineCoreOutput,
        error: str | None,
    ) -> RequestOutput | None:
        """The RequestOutput of one sequence's update (joined with its siblings when n > 1)."""
        request_id, completions, all_finished = state.request_id, [completion], finished
        parent = state.parent
        if parent is not None:
            if parent.error is None:
                parent.error = error  # the joined output reports it, whichever child ends last
            merged = parent.merge(completion)
            if merged is None:
                return None
            request_id, completions = parent.request_id, merged
            all_finished = parent.unfinished == 0
            if all_finished:
                self.parents.pop(request_id, None)
            error = parent.error
        prompt_lps = state.prompt_logprobs
        if prompt_lps is not None and state.params.output_kind == RequestOutputKind.DELTA:
            if state.sent_prompt_logprobs:
                prompt_lps = None  # a delta carries them once
            state.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=all_finished,
            num_cached_tokens=out.num_cached_tokens,
            metrics=state.metrics,
            error=error,
            user=state.user,
            prompt_logprobs=prompt_lps,
            kv_transfer_params=out.kv_transfer_params,
        )
