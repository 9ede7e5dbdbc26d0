"""Running one HTTP request's generations on AsyncLLM: merging prompts, first output, accumulation.

A completion request may carry several prompts; each is one AsyncLLM request
(with its own n choices). Their delta outputs are merged into one stream of
``(prompt_index, RequestOutput)``. Choice ``i`` of prompt ``p`` is OpenAI's
choice index ``p * n + i``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from baton.errors import BatonError, InvalidRequestError, StructuredOutputError
from baton.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from baton_openai.http.errors import OpenAIError, from_baton_error
from baton_openai.pipeline.params import BuiltParams
from baton_openai.protocol.openai import Usage

Item = tuple[int, RequestOutput]


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[Item]:
    """Interleave several AsyncLLM streams; closing the merge closes (aborts) them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def to_openai_error(e: BaseException, built: BuiltParams) -> OpenAIError:
    err = from_baton_error(e, built.param_names)
    if isinstance(e, StructuredOutputError) and built.structured_param:
        err.param = built.structured_param
    elif isinstance(e, InvalidRequestError) and err.param is None:
        err.param = built.prompt_param  # the input checks that are not about a sampling field
    return err


async def first_output(stream: AsyncIterator[Item], built: BuiltParams) -> Item | None:
    """The first output (validation and admission errors surface here, before any byte is sent)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except BatonError as e:
        raise to_openai_error(e, built) from None


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Accumulator:
    """Choices and usage of one HTTP request, fed with delta outputs."""

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.n = n
        self.prompt_lens = prompt_lens
        self.choices: dict[int, Choice] = {}
        self.cached_tokens = 0
        #: prompt index -> its prompt logprobs (requests with prompt_logprobs)
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}
        #: what the KV connector returned when the request finished (kv_transfer_params)
        self.kv_transfer_params: dict[str, Any] | None = None

    def index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.n + c.index

    def add(self, prompt_index: int, out: RequestOutput, keep: bool) -> None:
        """Count (and with ``keep``, store) each delta; ``keep=False`` when streaming."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt_index, out.prompt_logprobs)
        for c in out.outputs:
            ch = self.choices.setdefault(self.index(prompt_index, c), Choice())
            ch.token_ids.extend(c.token_ids)  # counted even when streaming: usage needs them
            if keep:
                ch.text.append(c.text)
                if c.logprobs:
                    ch.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        if out.finished:
            self.cached_tokens += out.num_cached_tokens
            if out.kv_transfer_params is not None:
                self.kv_transfer_params = out.kv_transfer_params

    def usage(self) -> Usage:
        prompt = sum(self.prompt_lens)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        details = {"cached_tokens": self.cached_tokens} if self.cached_tokens else None
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )


async def collect(
    stream: AsyncIterator[Item], first: Item | None, acc: Accumulator, built: BuiltParams
) -> None:
    """Drain a stream into ``acc`` (non-streaming responses)."""
    if first is not None:
        acc.add(*first, keep=True)
    try:
        async for item in stream:
            acc.add(*item, keep=True)
    except BatonError as e:
        raise to_openai_error(e, built) from None
    finally:
        with contextlib.suppress(BatonError):
            await stream.aclose()  # type: ignore[attr-defined]
