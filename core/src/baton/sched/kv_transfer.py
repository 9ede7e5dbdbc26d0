"""The scheduler's side of the KV-connector seam (``[kv_transfer]``; the halves' protocols and the
request's path are in ``baton.kv_transfer.connector``, the walk-through in docs/kv-connectors.md).

``KVTransfer`` wraps the connector's scheduler half (``Scheduler.kv_connector``) with the
kernel's books:

- admission (``lookup`` / ``allocated``): after the pool's own prefix hits, the tokens the
  connector supplies; a synchronous load is computed in the step that schedules the request,
  an asynchronous one parks it in WAITING_FOR_KV, holding its blocks, until every worker
  reported it (``update``): then its loaded tokens count as computed (a shortfall is
  recomputed), its loaded full blocks enter the prefix cache and it waits to be scheduled;
- each step (``build``): the full blocks the step's forward completes (drafts excluded), the
  requests finished and preempted since the last step, into ``build_connector_meta``'s bytes;
- ends (``release``): ``request_finished`` on every end (preemption is none); the blocks of a
  request the connector holds, or whose asynchronous load is still running, are freed once a
  worker reports it;
- containment: a call about one request that raises fails that request (``FINISHED_ERROR``,
  the message naming the connector); a worker's ``failed`` fails its requests; a worker half
  that failed a whole step (``step_error``) fails the requests with connector work in it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from baton.errors import InvalidRequestError
from baton.kv_transfer.connector import KVBlockRef, KVConnectorScheduler, KVStep
from baton.protocol import EngineCoreOutput, FinishReason, KVConnectorOutput, KVTransferStats
from baton.request import Request, RequestStatus

if TYPE_CHECKING:
    from baton.kv.events import KVCacheEvent
    from baton.sched.scheduler import Scheduler

log = logging.getLogger(__name__)

T = TypeVar("T")

_ERROR = RequestStatus.FINISHED_ERROR
_WAITING_FOR_KV = RequestStatus.WAITING_FOR_KV
#: Why a finished request's blocks are still held.
_LOAD, _SAVE = "load", "save"


class KVConnectorCallError(Exception):
    """A scheduler-half call raised; ``message`` names the connector, the call and the error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class KVTransfer:
    """The kernel's books around one connector's scheduler half (see the module docstring)."""

    def __init__(
        self, sched: Scheduler, connector: KVConnectorScheduler, name: str, role: str
    ) -> None:
        self.sched = sched
        self.connector = connector
        self.name = name
        self.loads = role != "producer"
        self.saves = role != "consumer"
        #: WAITING_FOR_KV requests: id -> (request, tokens the pool had, tokens asked to load).
        self.loading: dict[str, tuple[Request, int, int]] = {}
        #: Finished requests whose blocks are held: id -> (request, what they wait for).
        self.held: dict[str, tuple[Request, set[str]]] = {}
        #: Requests given load orders since the last step was built (their first step's work).
        self._ordered: set[str] = set()
        #: step id -> requests with connector work in that step (failed by a worker step_error),
        #: and the error of its build_connector_meta (which fails them all) if it raised.
        self._step_work: dict[int, tuple[set[str], str | None]] = {}
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        #: Outputs of requests failed outside a step's update (admission), sent with the next.
        self.failed_outputs: list[EngineCoreOutput] = []

    # ------------------------------------------------------------------ calls, contained

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as e:  # the connector's fault: what the call was about fails
            message = f"KV connector {self.name!r}: {what} raised {type(e).__name__}: {e}"
            if isinstance(e, InvalidRequestError):
                # the request's own fault (its kv_transfer_params): the client gets the error's
                # class first ("ClassName: text", error_from_message), so an HTTP server's 400
                message = f"{type(e).__name__}: {e} (KV connector {self.name!r}, {what})"
            log.warning("%s", message)
            log.debug("%s: traceback", what, exc_info=e)
            raise KVConnectorCallError(message) from e

    def fail(self, req: Request, message: str) -> EngineCoreOutput:
        """Finish ``req`` with an error now (blocks released) and return its output."""
        self.loading.pop(req.request_id, None)  # its load is over, whatever the worker did
        return self.sched._finish_with_error(req, message)

    def fail_later(self, req: Request, message: str) -> None:
        """``fail`` a request outside a step's update; its output goes with the next update."""
        self.failed_outputs.append(self.fail(req, message))

    # ------------------------------------------------------------------ admission

    def lookup(self, req: Request, num_hit: int) -> tuple[int, bool]:
        """Tokens the connector supplies after ``num_hit`` pool hits (whole blocks, never the
        last token), and whether they load asynchronously. KVConnectorCallError if it raised."""
        if not self.loads or req.request_id in self.sched.kv.req_to_blocks:
            return 0, False  # it holds its blocks already: a fork, or its load finished
        if req.skip_reading_prefix_cache or (
            req.sampling_params.prompt_logprobs is not None and not req.num_output_tokens
        ):
            return 0, False  # its prompt must be computed, as for the pool's own prefix cache
        n, is_async = self._call(
            "get_num_new_matched_tokens", self.connector.get_num_new_matched_tokens, req, num_hit
        )
        bs = self.sched.block_size
        room = (req.num_tokens - 1) // bs * bs - num_hit  # the last token is always computed
        n = max(0, min(int(n), room)) // bs * bs
        return n, bool(is_async) and n > 0

    def allocated(self, req: Request, num_hit: int, num_external: int) -> None:
        """The request's blocks are allocated: the connector's ``update_state_after_alloc``
        (``num_computed_tokens`` is then the pool's hits, as ``lookup`` was told)."""
        rid = req.request_id
        req.num_computed_tokens = num_hit
        block_ids = list(self.sched.kv.get_block_ids(rid))
        self._call(
            "update_state_after_alloc",
            self.connector.update_state_after_alloc,
            req,
            block_ids,
            num_external,
        )
        if num_external:
            self._ordered.add(rid)

    def park(self, req: Request, num_hit: int, num_external: int) -> None:
        """An asynchronous load started: ``req`` holds its blocks in WAITING_FOR_KV."""
        self.sched.policy.pop(req)
        req.status = _WAITING_FOR_KV
        self.loading[req.request_id] = (req, num_hit, num_external)

    def _loaded(self, rid: str, num_loaded: int) -> None:
        """Every worker finished ``rid``'s load, ``num_loaded`` tokens of it: it may run."""
        entry = self.loading.pop(rid, None)
        if entry is None:
            self._unhold(rid, _LOAD)
            return
        req, num_hit, asked = entry
        bs = self.sched.block_size
        loaded = max(0, min(num_loaded, asked)) // bs * bs  # a shortfall is recomputed
        if loaded < asked:
            log.info(
                "request %s: KV connector %r loaded %d of %d tokens; the rest is recomputed",
                rid,
                self.name,
                loaded,
                asked,
            )
        req.num_computed_tokens = num_hit + loaded
        req.num_cached_tokens = num_hit + loaded
        if self.sched.enable_caching:
            self.sched.kv.cache_blocks(req, req.num_computed_tokens)
        # it was admitted before the requests queued meanwhile and holds its blocks: it goes back
        # as a preempted request does (the policy's contract: ahead of later arrivals), else a
        # tight pool deadlocks (the queue's head waits for the blocks this request holds)
        req.status = RequestStatus.PREEMPTED
        self.sched.policy.add(req)
        req.status = RequestStatus.WAITING

    # ------------------------------------------------------------------ each step

    def build(
        self, step_id: int, num_scheduled: dict[str, int], spec: dict[str, list[int]]
    ) -> bytes | None:
        """The step's KVStep to ``build_connector_meta``; its bytes (None if it raised: the
        requests with connector work in the step then fail with the step's update)."""
        step = KVStep(step_id=step_id)
        work = self._ordered
        self._ordered = set()
        if self.saves:
            work |= self._new_full_blocks(step, num_scheduled, spec)
        step.finished_req_ids, self._finished_ids = self._finished_ids, []
        step.preempted_req_ids, self._preempted_ids = self._preempted_ids, []
        try:
            meta = self._call("build_connector_meta", self.connector.build_connector_meta, step)
        except KVConnectorCallError as e:
            self._step_work[step_id] = (work, e.message)
            return None
        self._step_work[step_id] = (work, None)
        return meta

    def _new_full_blocks(
        self, step: KVStep, num_scheduled: dict[str, int], spec: dict[str, list[int]]
    ) -> set[str]:
        """Fill ``step.new_full_blocks``: per request, the blocks this step's forward fills."""
        requests, bs = self.sched.requests, self.sched.block_size
        get_ids = self.sched.kv.get_block_ids
        out = step.new_full_blocks
        for rid, n in num_scheduled.items():
            req = requests[rid]
            after = req.num_computed_tokens
            drafts = spec.get(rid)
            upto = min((after - (len(drafts) if drafts else 0)) // bs, len(req.block_hashes))
            start = (after - n) // bs
            if upto > start:
                ids, hashes = get_ids(rid), req.block_hashes
                out[rid] = [KVBlockRef(ids[i], hashes[i]) for i in range(start, upto)]
        return set(out)

    def update(
        self, step_id: int, output: KVConnectorOutput | None, in_step: dict[str, int]
    ) -> tuple[dict[str, str], list[EngineCoreOutput]]:
        """Apply the workers' merged report of step ``step_id``: returns the failures of requests
        in the step (failed with the step's update) and the outputs of others it failed."""
        work, meta_error = self._step_work.pop(step_id, (set(), None))
        failed: dict[str, str] = dict.fromkeys(work, meta_error) if meta_error else {}
        outputs, self.failed_outputs = self.failed_outputs, []
        if output is not None:
            try:
                self._call(
                    "update_connector_output", self.connector.update_connector_output, output
                )
            except KVConnectorCallError as e:
                failed.update(dict.fromkeys(output.finished_loading, e.message))
            for rid, message in output.failed.items():
                failed[rid] = f"KV connector {self.name!r}: {message}"
            if output.step_error is not None:
                message = f"KV connector {self.name!r}: {output.step_error}"
                failed.update(dict.fromkeys((*work, *self.loading), message))
            for rid, n in output.finished_loading.items():
                if rid not in failed:
                    self._loaded(rid, n)
            for rid in output.finished_saving:
                self._unhold(rid, _SAVE)
        in_step_failed: dict[str, str] = {}
        for rid, message in failed.items():
            req = self.sched.requests.get(rid)
            if rid in in_step:
                in_step_failed[rid] = message
            elif req is not None:
                outputs.append(self.fail(req, message))
            else:  # a finished request the worker failed: nothing more comes for it
                self._unhold(rid, _LOAD, _SAVE)
        return in_step_failed, outputs

    # ------------------------------------------------------------------ ends

    def preempted(self, rid: str) -> None:
        self._preempted_ids.append(rid)

    def release(self, req: Request, may_hold: bool = True) -> tuple[bool, str | None]:
        """``req`` finished: ``request_finished``; whether its blocks are held (until a worker
        reports them; never when ``may_hold`` is false: forks keep them), and an error message
        if the connector raised."""
        rid = req.request_id
        self._finished_ids.append(rid)
        waits: set[str] = set()
        if self.loading.pop(rid, None) is not None and may_hold:
            waits.add(_LOAD)  # its load still writes into its blocks
        error = None
        try:
            hold, params = self._call(
                "request_finished",
                self.connector.request_finished,
                req,
                list(self.sched.kv.get_block_ids(rid)),
            )
        except KVConnectorCallError as e:
            hold, params, error = False, None, e.message
        if hold and may_hold:
            waits.add(_SAVE)
        if params is not None:
            req.kv_transfer_params = params
        if waits:
            self.held[rid] = (req, waits)
        return bool(waits), error

    def _unhold(self, rid: str, *why: str) -> None:
        """A worker reported ``rid`` (its load, its saves): its blocks go once nothing else is
        awaited."""
        entry = self.held.get(rid)
        if entry is None:
            return
        req, waits = entry
        waits.difference_update(why)
        if not waits:
            del self.held[rid]
            self.sched.kv.free(req)

    def busy(self) -> bool:
        """Whether loads or held blocks wait for a worker's report (the engine keeps stepping)."""
        return bool(self.loading or self.held or self.failed_outputs)

    def take_stats(self) -> KVTransferStats | None:
        try:
            return self._call("take_stats", self.connector.take_stats)
        except KVConnectorCallError:
            return None

    def take_events(self) -> list[KVCacheEvent]:
        """The connector's KV events (its tiers' blocks); [] when the call raised (logged)."""
        try:
            return self._call("take_events", self.connector.take_events)
        except KVConnectorCallError:
            return []

    def shutdown(self) -> None:
        with contextlib.suppress(KVConnectorCallError):  # logged; the engine stops anyway
            self._call("shutdown", self.connector.shutdown)


def finish_output(out: EngineCoreOutput, req: Request, error: str | None) -> None:
    """A finished request's output gets the connector's ``kv_transfer_params``, or its error."""
    if error is not None:
        req.error = error
        req.status = _ERROR
        out.finish_reason = FinishReason.ERROR
        out.error = error
    out.kv_transfer_params = req.kv_transfer_params
