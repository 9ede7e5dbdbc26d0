"""Client-supplied chat templates, rendered in child processes that are killed at a deadline.

A Jinja template is a program: one with a nested loop runs for hours, and no
thread can be stopped. So a client's template renders in a worker process
(templates/worker.py: Jinja's immutable sandbox, an address-space limit) and the
server waits for its answer on the event loop; at the deadline the process is
killed and the next request starts a fresh one. At most ``size`` render at a
time; idle workers are kept for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from typing import Any

from baton_openai.templates.worker import HEADER

log = logging.getLogger("baton_openai")

#: Address space a worker may map: the interpreter and Jinja, plus room for the messages and
#: the rendered chat (a few copies of each, as Python strings take up to 4 bytes a character).
BASE_MEMORY = 512 * 1024**2
#: A worker that is not ready this long after its start is killed (an import should take < 1 s).
START_TIMEOUT_S = 30.0


class SandboxBusy(Exception):
    """No worker became free before the deadline."""


class SandboxTimeout(Exception):
    """The template was still rendering at the deadline; its worker was killed."""


class TemplateRenderError(Exception):
    """The template failed (a Jinja error, raise_exception, too much memory or output)."""


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, memory_limit: int, max_output_chars: int) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "baton_openai.templates.worker",
            str(memory_limit),
            str(max_output_chars),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=2**16,
        )
        worker = cls(proc)
        try:
            ready = await asyncio.wait_for(worker.read(max_bytes=1024), START_TIMEOUT_S)
            if ready != {"ready": True}:
                raise TemplateRenderError(f"the template worker started badly: {ready!r}")
        except BaseException:
            await worker.kill()
            raise
        return worker

    async def read(self, max_bytes: int) -> Any:
        assert self.proc.stdout is not None
        (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        if size > max_bytes:
            raise TemplateRenderError(
                f"the rendered chat is larger than {max_bytes} bytes (server.max_request_bytes)"
            )
        return json.loads(await self.proc.stdout.readexactly(size))

    async def call(self, request: bytes, max_reply_bytes: int) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(HEADER.pack(len(request)) + request)
        await self.proc.stdin.drain()
        return await self.read(max_reply_bytes)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5)


class TemplateSandbox:
    """Renders client templates in up to ``size`` worker processes, each render within a deadline."""

    def __init__(self, size: int, max_output_chars: int) -> None:
        self.size = size
        self.max_output_chars = max_output_chars
        # a reply is ASCII JSON: a character takes at most 12 bytes (an escaped surrogate pair)
        self.max_reply_bytes = 12 * max_output_chars + 4096
        self.memory_limit = BASE_MEMORY + 16 * max_output_chars
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Worker] = []
        #: Pids of the workers killed so far (at a deadline, or broken): the tests look.
        self.killed: list[int] = []
        self.started: list[int] = []

    @property
    def idle_pids(self) -> list[int]:
        """Pids of the workers waiting for a template, the next one taken last."""
        return [w.pid for w in self._idle]

    async def render(
        self,
        template: str,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        variables: dict[str, Any],
        deadline: float,
    ) -> str:
        """The rendered chat; SandboxBusy, SandboxTimeout or TemplateRenderError otherwise."""
        request = json.dumps(
            {
                "template": template,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "variables": variables,
            },
            ensure_ascii=True,
        ).encode("ascii")
        try:
            await asyncio.wait_for(self._slots.acquire(), _left(deadline))
        except TimeoutError:
            raise SandboxBusy from None
        try:
            worker = await self._take(deadline)
            try:
                reply = await asyncio.wait_for(
                    worker.call(request, self.max_reply_bytes), _left(deadline)
                )
            except TimeoutError:
                await self._discard(worker, "ran past its deadline")
                raise SandboxTimeout from None
            except (OSError, asyncio.IncompleteReadError, ValueError, TemplateRenderError) as e:
                await self._discard(worker, f"broke: {type(e).__name__}: {e}")
                code = worker.proc.returncode
                raise TemplateRenderError(
                    f"the chat template's renderer failed ({type(e).__name__}: {e}; "
                    f"exit code {code})"
                ) from None
            except BaseException:  # cancelled mid-render: a reply may still come, so no reuse
                await self._discard(worker, "was cancelled")
                raise
            self._idle.append(worker)
        finally:
            self._slots.release()
        if "error" in reply:
            raise TemplateRenderError(str(reply["error"]))
        return str(reply["text"])

    async def _take(self, deadline: float) -> _Worker:
        while self._idle:
            worker = self._idle.pop()
            if worker.proc.returncode is None:
                return worker
        try:
            worker = await asyncio.wait_for(
                _Worker.start(self.memory_limit, self.max_output_chars), _left(deadline)
            )
        except TimeoutError:
            raise SandboxBusy from None
        self.started.append(worker.pid)
        return worker

    async def _discard(self, worker: _Worker, why: str) -> None:
        log.warning("client chat template worker %d %s: killing it", worker.pid, why)
        await worker.kill()
        self.killed.append(worker.pid)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for worker in idle:
            await worker.kill()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
