"""The kernel's structured-output seam.

A request with a spec enters WAITING_FOR_FSM while its grammar compiles on a
thread pool (compiled grammars cached by spec); the scheduler holds it aside
until ``request.grammar`` is set. Each step the core asks for the batch's
bitmask while the forward runs. The backend is a plugin, created on the first
request that needs it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from baton.config import BatonConfig
from baton.engine.plugin_check import resolve_structured_output_backend
from baton.errors import StructuredOutputError
from baton.model_info import ModelInfo
from baton.plugins import Registry
from baton.protocol import GrammarOutput, SchedulerOutput
from baton.request import Request, RequestStatus

if TYPE_CHECKING:
    from baton.interfaces import StructuredOutputBackend
    from baton.sched.scheduler import Scheduler

log = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, config: BatonConfig, registry: Registry, info: ModelInfo) -> None:
        self.config = config
        self.registry = registry
        self.info = info
        self.backend_name = resolve_structured_output_backend(config, registry)
        self._backend: StructuredOutputBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: dict[tuple[str, str], Future[Any]] = {}
        self._failed: list[tuple[Request, str]] = []
        self._lock = threading.Lock()
        self._bitmask: Any = None

    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            if self.backend_name is None:
                raise StructuredOutputError(
                    "this request has a structured-output spec but no structured-output backend is "
                    "installed (structured_output.backend = "
                    f"{self.config.structured_output.backend!r}): pip install baton-plugin-xgrammar"
                )
            from transformers import AutoTokenizer

            entry = self.registry.get("structured_output", self.backend_name)
            settings = self.config.plugin_settings("structured_output", entry.name, entry.settings_model)
            tokenizer = AutoTokenizer.from_pretrained(self.config.model.tokenizer or self.info.path)
            self._backend = entry.create(self.config, settings, tokenizer, self.info.vocab_size)
        return self._backend

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar; the request waits (WAITING_FOR_FSM) until it is ready."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        backend = self.backend  # raises before the request is admitted when there is no backend
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.config.structured_output.compile_threads, thread_name_prefix="baton-grammar"
            )
        key = spec.key()
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(backend.compile, spec)
        request.status = RequestStatus.WAITING_FOR_FSM
        future.add_done_callback(lambda f: self._on_compiled(request, f))

    def _on_compiled(self, request: Request, future: Future[Any]) -> None:
        try:
            request.grammar = self.backend.matcher(future.result())
        except Exception as e:  # reported on this request only; the engine serves the others
            message = str(e) if isinstance(e, StructuredOutputError) else f"{type(e).__name__}: {e}"
            log.warning("request %s: structured-output spec failed to compile: %s", request.request_id, message)
            with self._lock:
                self._failed.append((request, f"StructuredOutputError: the structured-output spec failed to compile: {message}"))
                self._compiled.pop(request.sampling_params.structured_outputs.key(), None)  # type: ignore[union-attr]

    def take_failed(self) -> list[tuple[Request, str]]:
        if not self._failed:
            return []
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def grammar_bitmask(self, scheduler: Scheduler, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """Fill the bitmask rows of this step's constrained requests (runs while the forward does)."""
        req_ids = scheduler_output.structured_output_req_ids
        if not req_ids:
            return None
        backend = self.backend
        rows = max(len(req_ids), self.config.scheduler.max_num_seqs)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = backend.allocate_bitmask(rows)
        bitmask = self._bitmask
        requests = scheduler.requests
        for i, rid in enumerate(req_ids):
            requests[rid].grammar.fill_bitmask(bitmask, i)
        # a copy: with a batch queue the next step refills the buffer before this one samples
        return GrammarOutput(req_ids=list(req_ids), bitmask=bitmask[: len(req_ids)].clone())

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
