"""The kernel's structured-output seam.

A request with a spec enters WAITING_FOR_FSM while its grammar compiles on a
thread pool (compiled grammars cached by spec); the scheduler holds it aside
until ``request.grammar`` is set. Each step the core asks for the batch's
bitmask while the forward runs. The backend is a plugin, created on the pool
the first time a request needs it (loading the tokenizer and building the
backend's vocabulary tables takes a second or more: never on the step thread).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from baton.config import StructuredOutputSection
from baton.errors import StructuredOutputError
from baton.protocol import GrammarOutput, SchedulerOutput
from baton.request import Request, RequestStatus
from baton.structured.drafts import fill_draft_rows

if TYPE_CHECKING:
    from baton.interfaces import StructuredOutputBackend
    from baton.sched.scheduler import Scheduler

log = logging.getLogger(__name__)

#: The chosen backend's factory with the engine's config bound: ``create(tokenizer, vocab_size)``.
BackendFactory = Callable[[Any, int], "StructuredOutputBackend"]

#: Compiled grammars kept by spec (least recently used dropped first).
COMPILED_CACHE_SIZE = 1024


class StructuredOutputManager:
    """Compiles grammars off the step thread and fills each step's bitmask. Driven by EngineCore."""

    def __init__(
        self,
        settings: StructuredOutputSection,
        *,
        backend_name: str | None,
        create_backend: BackendFactory | None,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        max_num_seqs: int,
    ) -> None:
        """``backend_name`` / ``create_backend``: the resolved backend (``structured_output.backend``)
        and its factory; None: none installed ("auto") or turned off ("none"). ``load_tokenizer``
        gives the model's tokenizer (called on the pool, on first use); ``vocab_size`` is the
        logits' width; ``max_num_seqs`` the fewest bitmask rows allocated."""
        self.settings = settings
        self.backend_name = backend_name if create_backend is not None else None
        self._create = create_backend
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self._backend: StructuredOutputBackend | None = None
        self._backend_error: BaseException | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._failed: list[tuple[Request, str]] = []
        self._lock = threading.Lock()
        self._bitmask: Any = None

    # ------------------------------------------------------------------ the backend

    def _check_available(self) -> None:
        if self.backend_name is not None:
            return
        setting = self.settings.backend
        if setting == "none":
            raise StructuredOutputError(
                "the request has a structured-output spec but structured output is turned off "
                "(structured_output.backend = 'none'): set it to 'xgrammar' (pip install baton-plugin-xgrammar)"
            )
        raise StructuredOutputError(
            "the request has a structured-output spec but no structured-output backend is installed "
            f"(structured_output.backend = {setting!r}): pip install baton-plugin-xgrammar"
        )

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, created on first use (thread-safe; a failure is remembered and raised again)."""
        backend = self._backend
        if backend is not None:
            return backend
        self._check_available()
        with self._backend_lock:
            if self._backend is None:
                if self._backend_error is not None:
                    raise self._backend_error
                try:
                    self._backend = self._create_backend()
                except Exception as e:  # every later request gets the same error, without retrying
                    self._backend_error = StructuredOutputError(
                        f"structured-output backend {self.backend_name!r} failed to start: {type(e).__name__}: {e}"
                    )
                    raise self._backend_error from e
            return self._backend

    def _create_backend(self) -> StructuredOutputBackend:
        assert self._create is not None
        tokenizer = self._load_tokenizer()
        log.info("structured output: backend %r, vocabulary %d", self.backend_name, self.vocab_size)
        # the model's vocabulary size (the logits' width), which may exceed the tokenizer's
        return self._create(tokenizer, self.vocab_size)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar; the request waits (WAITING_FOR_FSM) until it is ready.

        Raises StructuredOutputError at once when no backend is available; any
        other failure (backend start-up, compile) finishes only this request,
        through ``take_failed``.
        """
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        self._check_available()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.settings.compile_threads, thread_name_prefix="baton-grammar"
            )
        key = spec.key()
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, spec)
                if len(self._compiled) > COMPILED_CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        request.status = RequestStatus.WAITING_FOR_FSM
        future.add_done_callback(lambda f: self._on_compiled(request, key, f))

    def _compile(self, spec: Any) -> Any:
        return self.backend.compile(spec)

    def _on_compiled(self, request: Request, key: tuple[str, str], future: Future[Any]) -> None:
        # runs on a pool thread (or on the caller's, when the grammar was already compiled)
        try:
            request.grammar = self.backend.matcher(future.result())
        except Exception as e:  # reported on this request only; the engine serves the others
            message = str(e) if isinstance(e, StructuredOutputError) else f"{type(e).__name__}: {e}"
            log.warning(
                "request %s: structured-output spec failed to compile: %s",
                request.request_id,
                message,
            )
            with self._lock:
                self._failed.append((request, f"StructuredOutputError: {message}"))
                if (
                    self._compiled.get(key) is future
                ):  # not cached: the same spec compiles afresh next time
                    del self._compiled[key]

    def take_failed(self) -> list[tuple[Request, str]]:
        """Requests whose grammar failed since the last call, with their error messages."""
        if not self._failed:
            return []
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    # ------------------------------------------------------------------ each step

    def grammar_bitmask(
        self, scheduler: Scheduler, scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        """Fill the bitmask rows of this step's constrained requests (runs while the forward does).

        A request verifying drafts gets a row per position (``fill_draft_rows``).

        A request whose matcher raises gets no row and is reported through ``take_failed``:
        the core finishes it before this step's tokens are applied. None when no row is filled.
        """
        req_ids = scheduler_output.structured_output_req_ids
        if not req_ids:
            return None
        backend = self.backend
        spec = scheduler_output.scheduled_spec_decode_tokens
        # a request verifying k drafts takes 1 + k rows, one per position
        n = len(req_ids) + sum(len(spec.get(rid, ())) for rid in req_ids) if spec else len(req_ids)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = backend.allocate_bitmask(max(n, self.max_num_seqs))
        bitmask = self._bitmask
        requests = scheduler.requests
        filled: list[str] = []
        for rid in req_ids:
            req = requests[rid]
            drafts = spec.get(rid) if spec else None
            try:  # the next rows: failures leave no gap
                if drafts:
                    rows = fill_draft_rows(req.grammar, drafts, bitmask, len(filled))
                else:
                    req.grammar.fill_bitmask(bitmask, len(filled))
                    rows = 1
            except Exception as e:  # this request fails alone (take_failed); the others go on
                self._report_fill_failure(req, e)
                continue
            filled.extend([rid] * rows)
        if not filled:
            return None
        # a copy: with a batch queue the next step refills the buffer before this one samples
        return GrammarOutput(req_ids=filled, bitmask=bitmask[: len(filled)].clone())

    def _report_fill_failure(self, request: Request, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        log.warning(
            "request %s: its grammar failed to fill the bitmask: %s", request.request_id, message
        )
        log.debug("request %s: traceback", request.request_id, exc_info=error)
        with self._lock:
            self._failed.append((request, message))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
