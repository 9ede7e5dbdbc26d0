"""The engine requests of one beam search (LLM.beam_search, AsyncLLM.beam_search).

Each step sends every live beam as a one-token request that keeps its KV when it finishes
(``retain_kv``) and forks the KV of the request its beam grew from (``fork_from``); once a
step's requests are added, the previous step's are aborted, which frees what the new ones
do not share. See docs/beam-search.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from baton.beam_search import BeamSearch, BeamSearchParams
from baton.errors import BatonError
from baton.frontend.prompts import InputProcessor
from baton.lora.request import LoRARequest
from baton.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from baton.sampling_params import SamplingParams


class BeamRun:
    """One beam search's steps: the requests to send, and which engine requests it holds."""

    def __init__(
        self,
        input_processor: InputProcessor,
        prompts: list[list[int]],
        params: BeamSearchParams,
        eos_token_id: int | None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        params.check()
        self.step = SamplingParams(
            max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width
        )
        whole = self.step.clone(max_tokens=params.max_tokens)  # the prompt's length checked
        self.infos = [input_processor.validate(ids, whole) for ids in prompts]
        self.input_processor = input_processor
        self.lora_request = lora_request
        self.search = BeamSearch(prompts, params, eos_token_id)
        #: This step's requests (running, or finished holding their KV).
        self.live: list[str] = []
        #: The previous step's, until the caller aborts them (``released``).
        self.previous: list[str] = []

    @property
    def held(self) -> list[str]:
        """Every engine request this search may still hold KV by: abort them if it stops."""
        return self.previous + self.live

    def requests(self, new_id: Callable[[], str]) -> list[EngineCoreRequest]:
        """This step's requests, one per live beam; add them, then abort ``previous``."""
        reqs = []
        for index, beam in self.search.live_beams():
            req = self.input_processor.process(
                new_id(),
                beam.tokens,
                self.step,
                scheduling=self.infos[index],
                lora_request=self.lora_request,
            )
            reqs.append(
                msgspec.structs.replace(req, retain_kv=True, fork_from=beam.parent_request_id)
            )
        self.previous, self.live = self.held, [r.request_id for r in reqs]
        return reqs

    def released(self) -> None:
        """The previous step's requests were aborted."""
        self.previous = []

    def advance(self, finished: Mapping[str, EngineCoreOutput]) -> None:
        """Grow the beams from this step's finished outputs (by request id)."""
        results = []
        for rid in self.live:
            out = finished[rid]
            if (
                out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)
                or not out.new_logprobs
            ):
                raise BatonError(
                    f"beam search request {rid!r} ended with {out.finish_reason} and no "
                    f"logprobs: {out.error or 'aborted'}"
                )
            results.append((rid, out.new_logprobs[0]))
        self.search.advance(results)
