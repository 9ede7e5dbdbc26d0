"""Beam search (vLLM's ``LLM.beam_search``): its parameters, results, and the search itself.

``BeamSearch`` holds the beams of a batch of prompts and decides, from each live beam's
top ``2 * beam_width`` next-token logprobs, which beams live on; it runs no model. The
caller (``LLM.beam_search``) sends each live beam to the engine as a one-token request
that forks the KV of the request its beam grew from (``EngineCoreRequest.fork_from``):
the prompt's KV is computed once and shared, never resubmitted.

Scores are vLLM's: ``cum_logprob / seq_len ** length_penalty``, ``seq_len`` counting the
prompt and the generated tokens, a final EOS not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from baton.errors import InvalidRequestError
from baton.protocol import TokenLogprobs


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def check(self) -> None:
        """Raise InvalidRequestError naming a bad field."""
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")


class BeamSearchSequence(msgspec.Struct, kw_only=True):
    """One beam: its tokens (the prompt's included), their summed logprob, its text."""

    tokens: list[int]
    cum_logprob: float = 0.0
    #: The generated tokens decoded (a final EOS left out); set on the returned beams only.
    text: str | None = None
    #: The id of the engine request whose KV this beam's tokens but its last are in.
    parent_request_id: str | None = None


class BeamSearchOutput(msgspec.Struct, kw_only=True):
    """One prompt's best beams, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's length-penalised score of a beam (``get_beam_search_score``)."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (seq_len**length_penalty)


class _Instance:
    """One prompt's search: its live beams and those that ended with EOS."""

    __slots__ = ("beams", "completed", "prompt_len")

    def __init__(self, prompt: list[int]) -> None:
        self.prompt_len = len(prompt)
        self.beams = [BeamSearchSequence(tokens=list(prompt))]
        self.completed: list[BeamSearchSequence] = []


class BeamSearch:
    """The beams of a batch of prompts, advanced one token per ``advance``."""

    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_id: int | None
    ) -> None:
        params.check()
        self.params = params
        self.eos_token_id = eos_token_id
        self._instances = [_Instance(p) for p in prompts]
        self._steps = 0

    @property
    def done(self) -> bool:
        """Whether max_tokens steps ran or no live beam is left."""
        return self._steps >= self.params.max_tokens or not any(i.beams for i in self._instances)

    def live_beams(self) -> list[tuple[int, BeamSearchSequence]]:
        """Every prompt's live beams with the prompt's index, in prompt order: each needs its
        next-token logprobs."""
        return [(i, b) for i, inst in enumerate(self._instances) for b in inst.beams]

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty
        )

    def advance(self, results: Sequence[tuple[str, TokenLogprobs]]) -> None:
        """Grow the beams from ``live_beams()``'s results, aligned with it: (the id of the
        request that computed the beam, its next-token logprobs: sampled token, then top-k)."""
        beams = self.live_beams()
        if len(results) != len(beams):
            raise ValueError(f"advance needs {len(beams)} results, got {len(results)}")
        eos, ignore_eos, width = self.eos_token_id, self.params.ignore_eos, self.params.beam_width
        it = iter(zip((b for _, b in beams), results, strict=True))
        for inst in self._instances:
            grown: list[BeamSearchSequence] = []
            for beam, (rid, lps) in (next(it) for _ in range(len(inst.beams))):
                # a dict as vLLM's: the sampled token appears once even when also in the top-k
                for tok, lp in dict(zip(lps.token_ids, lps.logprobs, strict=True)).items():
                    new = BeamSearchSequence(
                        tokens=[*beam.tokens, tok],
                        cum_logprob=beam.cum_logprob + lp,
                        parent_request_id=rid,
                    )
                    (inst.completed if tok == eos and not ignore_eos else grown).append(new)
            inst.beams = sorted(grown, key=self._score, reverse=True)[:width]
        self._steps += 1

    def outputs(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """Each prompt's best beams, best first, their text decoded with ``decode(ids)``."""
        out = []
        for inst in self._instances:
            best = sorted([*inst.completed, *inst.beams], key=self._score, reverse=True)
            best = best[: self.params.beam_width]
            for beam in best:
                gen = beam.tokens[inst.prompt_len :]
                if gen and gen[-1] == self.eos_token_id and not self.params.ignore_eos:
                    gen = gen[:-1]
                beam.text = decode(gen)
                beam.parent_request_id = None
            out.append(BeamSearchOutput(sequences=best))
        return out
