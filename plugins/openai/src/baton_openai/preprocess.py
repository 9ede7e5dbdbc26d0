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
sandboxed process that is killed at the deadline (template_sandbox.py); only
the rendered text comes back to be tokenized here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from baton import AsyncLLM
from baton.config import ServerSection
from baton.errors import InvalidRequestError
from baton.frontend.input_processor import RESERVED_CHAT_TEMPLATE_KWARGS
from baton.validation import check_text
from baton_openai.errors import OpenAIError
from baton_openai.template_sandbox import (
    SandboxBusy,
    SandboxTimeout,
    TemplateRenderError,
    TemplateSandbox,
)

T = TypeVar("T")


class Preprocessor:
    """Renders and tokenizes requests in worker threads (and client templates in a sandbox)."""

    def __init__(self, engine: AsyncLLM, settings: ServerSection) -> None:
        self.engine = engine
        self.timeout = settings.preprocess_timeout
        self.workers = settings.preprocess_workers
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="baton-preprocess")
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
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
        client_template: str | None,
        *,
        deadline: float,
    ) -> list[int]:
        """The prompt token ids of a chat request (the server's template, or the client's).

        InvalidRequestError (naming its param) for bad messages, variables or template output.
        """
        what = "rendering the chat template and tokenizing the messages"
        if client_template is None:
            return await self.run(
                lambda: self.engine.render_chat(
                    messages,
                    add_generation_prompt=add_generation_prompt,
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
        tokenizer = self.engine.tokenizer
        variables = await self.run(
            lambda: client_template_variables(messages, template_kwargs, tokenizer),
            deadline=deadline,
            what=what,
            param="messages",
        )
        try:
            text = await self.sandbox.render(
                client_template,
                messages,
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

        def encode() -> list[int]:
            # as apply_chat_template does: the template wrote the special tokens itself
            check_text(text, "the rendered chat", param="messages")
            return list(tokenizer.encode(text, add_special_tokens=False))

        return await self.run(encode, deadline=deadline, what=what, param="messages")

    async def aclose(self) -> None:
        """Stop the sandbox processes; running threads finish on their own (they are bounded)."""
        if self.sandbox is not None:
            await self.sandbox.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)


def client_template_variables(
    messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None, tokenizer: Any
) -> dict[str, Any]:
    """The checks render_chat makes before rendering, and the variables a client template sees:
    the tokenizer's special tokens, then chat_template_kwargs (which win, as in transformers)."""
    for i, m in enumerate(messages):
        for key, value in m.items():
            if isinstance(value, str):
                check_text(value, f"messages[{i}].{key}", param="messages")
    kwargs = dict(template_kwargs or {})
    for key in kwargs:
        why = RESERVED_CHAT_TEMPLATE_KWARGS.get(key)
        if why is not None:
            raise InvalidRequestError(
                f"chat_template_kwargs: {key!r} is an option of apply_chat_template, not a "
                f"template variable ({why}); remove it",
                param="chat_template_kwargs",
            )
    return {**special_tokens(tokenizer), **kwargs}


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
