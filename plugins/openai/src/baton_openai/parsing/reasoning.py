"""The built-in reasoning parser ``think``: ``<think>...</think>`` becomes ``reasoning_content``.

An answer that starts with ``<think>`` (after blanks) has its reasoning up to
``</think>`` (to the end when the tag never closes, e.g. cut by max_tokens); the
text after the closing tag, leading blanks dropped, is the content. An answer
that does not start with the tag is all content. Streamed, the same split comes
out delta by delta: a partial tag is held back until the next delta decides it.
"""

from __future__ import annotations

from typing import Any

from baton_openai.parsing.types import ReasoningDelta, ReasoningSplit, ReasoningStream, held_back


class ThinkReasoningParser:
    """``<think>`` / ``</think>`` (DeepSeek-R1, Qwen3, SmolLM3 ...)."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def split(self, text: str) -> ReasoningSplit:
        head = text.lstrip()
        if not head.startswith(self.OPEN):
            return ReasoningSplit(content=text or None)
        body = head[len(self.OPEN) :]
        reasoning, closed, rest = body.partition(self.CLOSE)
        content = rest.lstrip() if closed else ""
        return ReasoningSplit(reasoning=reasoning, content=content or None)

    def stream(self) -> ReasoningStream:
        return _ThinkStream()


class _ThinkStream:
    def __init__(self) -> None:
        self.buf = ""
        # start: undecided; reasoning: inside the tags; after: content, blanks not yet dropped;
        # content: the rest is content
        self.state = "start"

    def feed(self, text: str) -> list[ReasoningDelta]:
        self.buf += text
        out: list[ReasoningDelta] = []
        open_, close = ThinkReasoningParser.OPEN, ThinkReasoningParser.CLOSE
        if self.state == "start":
            head = self.buf.lstrip()
            if not head or (len(head) < len(open_) and open_.startswith(head)):
                return out
            if head.startswith(open_):
                self.buf, self.state = head[len(open_) :], "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(close)
            if i < 0:
                keep = held_back(self.buf, close)
                self._emit(out, "reasoning", self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            self._emit(out, "reasoning", self.buf[:i])
            self.buf, self.state = self.buf[i + len(close) :], "after"
        if self.state == "after":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return out
            self.state = "content"
        self._emit(out, "content", self.buf)
        self.buf = ""
        return out

    def end(self) -> list[ReasoningDelta]:
        out: list[ReasoningDelta] = []
        kind = "reasoning" if self.state == "reasoning" else "content"
        if self.state != "after":
            self._emit(out, kind, self.buf)
        self.buf = ""
        return out

    @staticmethod
    def _emit(out: list[ReasoningDelta], kind: str, text: str) -> None:
        if text:
            out.append(ReasoningDelta(kind=kind, text=text))  # type: ignore[arg-type]
