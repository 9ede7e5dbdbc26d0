"""Incremental detokenisation and stop strings, one instance per sequence.

Text grows token by token through tokenizers' DecodeStream, which holds back
bytes until a UTF-8 character is complete, so no multi-byte character is ever
split. Stop strings are searched only in the newly decoded text plus a
lookback of (longest stop - 1) characters. While stop strings are active and
``include_stop_str_in_output`` is off, that many trailing characters are held
back from streamed deltas so a stop string that completes later never leaks.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from baton.sampling_params import SamplingParams


class IncrementalDetokenizer:
    __slots__ = (
        "_hold",
        "_include_stop",
        "_stop",
        "_stop_lookback",
        "_stream",
        "_tokenizer",
        "num_kept",
        "output_text",
        "sent_offset",
        "stop_reason",
    )

    def __init__(
        self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int] | None = None
    ) -> None:
        # the Rust tokenizer behind a transformers fast tokenizer
        self._tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stop: list[str] = list(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._stop_lookback = max((len(s) for s in self._stop), default=0)
        self._hold = 0 if self._include_stop else max(self._stop_lookback - 1, 0)
        self.output_text = ""
        self.sent_offset = 0  # how much of output_text was handed out as deltas
        self.stop_reason: str | None = None
        #: How many of the last ``update``'s tokens the sequence keeps (all but past a stop string).
        self.num_kept = 0

    def update(self, new_token_ids: list[int]) -> bool:
        """Decode new tokens; return True when a stop string ended the sequence, after
        ``num_kept`` of them: the one whose text completed it and those before, so that several
        tokens at once (speculation, several decode steps) stop where one at a time would."""
        text = self.output_text
        self.num_kept = len(new_token_ids)
        for i, tid in enumerate(new_token_ids):
            piece = self._stream.step(self._tokenizer, tid)
            if not piece:
                continue
            start = len(text)
            text += piece
            if self._stop:
                hit = self._find_stop(text, start)
                if hit is not None:
                    self.output_text = text[:hit]
                    self.num_kept = i + 1
                    return True
        self.output_text = text
        return False

    def _find_stop(self, text: str, new_start: int) -> int | None:
        """Where to cut the text if a stop string occurs in the new part, else None."""
        search_from = max(new_start - self._stop_lookback + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            i = text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.stop_reason = stop
        return i + len(stop) if self._include_stop else i

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet (minus the stop-string holdback while running)."""
        end = (
            len(self.output_text)
            if finished
            else max(len(self.output_text) - self._hold, self.sent_offset)
        )
        delta = self.output_text[self.sent_offset : end]
        self.sent_offset = end
        return delta

    def visible_text(self, finished: bool) -> str:
        """Cumulative text, without the holdback while running."""
        if finished or not self._hold:
            return self.output_text
        return self.output_text[: max(len(self.output_text) - self._hold, 0)]
