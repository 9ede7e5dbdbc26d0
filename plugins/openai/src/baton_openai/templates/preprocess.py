"""Chat templates and tokenization off the event loop, each request within a time limit.

The server's own template and the tokenizer run in a thread pool of
``server.preprocess_workers`` threads: HF tokenizers release the GIL and Jinja
yields it every few milliseconds, so the event loop (and ``/health``) stays
responsive. A request's whole preprocessing must finish within
``server.preprocess_timeout`` seconds, waiting for a worker included; a thread
that runs over keeps going until it finishes on its own (the server's template
and the tokenizer terminate), but the request is answered at once.

A client's own template (``chat_template``) is untrusted code: it is refused
unless ``server.allow_client_chat_template`` is on, and then rendered in a
sandboxed process that is killed at the deadline (templates/sandbox.py); only
the rendered text comes back to be tokenized here.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from baton import AsyncLLM
from baton_openai.http.errors import OpenAIError
from baton_openai.server_section import ServerSection
from baton_openai.templates.chat_template import load_chat_template
from baton_openai.templates.sandbox import (
    SandboxBusy,
    SandboxTimeout,
    TemplateRenderError,
    TemplateSandbox,
)

T = TypeVar("T")


class DaemonThreadPool:
    """A fixed pool of daemon threads running submitted callables.

    Not a ThreadPoolExecutor: that one joins its threads at interpreter exit, so a
    tokenization that outlived its request's deadline would hold up the server's shutdown.
    """

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            job = None  # drop the references while idle
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued (its request timed out)
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting request
                future.set_exception(e)
            else:
                future.set_result(result)
            future = fn = None  # type: ignore[assignment]

    def shutdown(self) -> None:
        """Cancel queued jobs and let the threads end (running jobs finish on their own)."""
        with contextlib.suppress(queue.Empty):
            while True:
                job = self._jobs.get_nowait()
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)


class Preprocessor:
    """Renders and tokenizes requests in worker threads (and client templates in a sandbox)."""

    def __init__(self, engine: AsyncLLM, settings: ServerSection) -> None:
        self.engine = engine
        self.timeout = settings.preprocess_timeout
        self.workers = settings.preprocess_workers
        self.pool = DaemonThreadPool(self.workers, "baton-preprocess")
        #: server.chat_template (instead of the tokenizer's); None: the tokenizer's
        self.chat_template = load_chat_template(settings.chat_template)
        self.sandbox: TemplateSandbox | None = None
        if settings.allow_client_chat_template:
            self.sandbox = TemplateSandbox(
                size=self.workers, max_output_chars=int(settings.max_request_bytes)
            )

    def deadline(self) -> float:
        """The monotonic time by which a request arriving now must be preprocessed."""
        return time.monotonic() + self.timeout

    async def run(self, fn: Callable[[], T], *, deadline: float, what: str, param: str) -> T:
        """``fn()`` on a worker thread; an OpenAIError if it is not done by ``deadline``."""
        submitted = time.monotonic()
        started: list[float] = []

        def job() -> T:
            started.append(time.monotonic())
            return fn()

        future = self.pool.submit(job)
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(future), max(0.0, deadline - time.monotonic())
            )
        except TimeoutError:
            future.cancel()  # not started yet: it never will be
            waited = (started[0] if started else time.monotonic()) - submitted
            raise self.timeout_error(what, param, ran=bool(started), waited=waited) from None

    def timeout_error(self, what: str, param: str, *, ran: bool, waited: float) -> OpenAIError:
        if not ran:
            return OpenAIError(
                f"the server is busy: no preprocessing worker became free within "
                f"server.preprocess_timeout ({self.timeout:g} s, {self.workers} workers); "
                "retry later, or raise server.preprocess_workers",
                503,
                code="server_busy",
            )
        queued = f", {waited:.1f} s of it waiting for a worker" if waited >= 0.05 else ""
        return OpenAIError(
            f"{what} took longer than server.preprocess_timeout ({self.timeout:g} s{queued}): "
            f"shorten the {param}, or raise server.preprocess_timeout",
            400,
            param=param,
            code="preprocess_timeout",
        )

    # ------------------------------------------------------------------ the two requests' work

    async def chat_ids(
        self,
        messages: Callable[[], list[dict[str, Any]]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
        client_template: str | None,
        *,
        deadline: float,
    ) -> list[int]:
        """The prompt token ids of a chat request (the server's template: server.chat_template
        or the tokenizer's; or the client's).

        ``messages()`` builds the template's messages (on a worker: a request may have many).
        InvalidRequestError (naming its param) for bad messages, variables or template output.
        """
        what = "rendering the chat template and tokenizing the messages"
        if client_template is None:
            return await self.run(
                lambda: self.engine.render_chat(
                    messages(),
                    add_generation_prompt=add_generation_prompt,
                    chat_template=self.chat_template,
                    chat_template_kwargs=template_kwargs,
                ),
                deadline=deadline,
                what=what,
                param="messages",
            )
        if self.sandbox is None:
            raise OpenAIError(
                "this server does not accept a client chat template (chat_template): leave it out "
                "to use the model's own, or start the server with "
                "server.allow_client_chat_template = true",
                400,
                param="chat_template",
                code="unsupported_parameter",
            )
        engine = self.engine

        def prepare() -> tuple[list[dict[str, Any]], dict[str, Any]]:
            msgs = messages()
            return msgs, client_template_variables(engine, msgs, template_kwargs)

        msgs, variables = await self.run(prepare, deadline=deadline, what=what, param="messages")
        try:
            text = await self.sandbox.render(
                client_template,
                msgs,
                add_generation_prompt=add_generation_prompt,
                variables=variables,
                deadline=deadline,
            )
        except SandboxBusy:
            raise self.timeout_error(what, "chat_template", ran=False, waited=0.0) from None
        except SandboxTimeout:
            raise OpenAIError(
                f"the client chat template did not finish within server.preprocess_timeout "
                f"({self.timeout:g} s) and was stopped: simplify the chat_template, or raise "
                "server.preprocess_timeout",
                400,
                param="chat_template",
                code="preprocess_timeout",
            ) from None
        except TemplateRenderError as e:
            raise OpenAIError(
                f"the chat template failed: {e}", 400, param="chat_template", code="invalid_value"
            ) from None

        return await self.run(
            lambda: engine.tokenize_rendered_chat(text),
            deadline=deadline,
            what=what,
            param="messages",
        )

    async def aclose(self) -> None:
        """Stop the sandbox processes and the threads; a job still running finishes on its own
        (its work is bounded) or, at exit, is dropped with its daemon thread."""
        if self.sandbox is not None:
            await self.sandbox.aclose()
        self.pool.shutdown()


def client_template_variables(
    engine: AsyncLLM,
    messages: list[dict[str, Any]],
    template_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The checks render_chat makes before rendering (the same refusals, the same messages),
    and the variables a client template sees: the tokenizer's special tokens, then
    chat_template_kwargs (which win, as in transformers)."""
    engine.check_messages(messages)
    variables = engine.chat_template_variables(template_kwargs)
    return {**special_tokens(engine.get_tokenizer()), **variables}


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's special tokens as template variables (bos_token, eos_token, ...), as
    apply_chat_template gives them."""
    out: dict[str, Any] = {}
    for name, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        if isinstance(value, list | tuple):
            out[name] = [str(v) for v in value]
        elif value is not None:
            out[name] = str(value)
    return out
