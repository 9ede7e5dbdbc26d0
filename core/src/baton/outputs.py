"""What the frontends return: RequestOutput with one CompletionOutput per sequence (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.metrics.stats import RequestMetrics


@dataclass(slots=True)
class Logprob:
    """One candidate token at one position."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


#: Per generated position: candidate token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt position: the prompt token plus the top-k there; None for the first (vLLM's).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (index i of n)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs so far (cumulative, delta or final, per SamplingParams.output_kind)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    user: str | None = field(default=None, repr=False)
    #: With SamplingParams.prompt_logprobs: once the prompt is computed (with DELTA, in the
    #: first output only).
    prompt_logprobs: PromptLogprobs | None = None
    #: With the final output: what the KV connector returned about the request (vLLM's
    #: ``kv_transfer_params``, e.g. where a consumer engine finds its KV); None: nothing.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result: one vector (vLLM's PoolingOutput)."""

    data: Any  # a 1-D float32 torch tensor

    @property
    def embedding(self) -> list[float]:
        """The vector as a list of floats (vLLM's EmbeddingOutput.embedding)."""
        return [float(x) for x in self.data.tolist()]


@dataclass(slots=True)
class PoolingRequestOutput:
    """What ``LLM.embed`` / ``AsyncLLM.encode`` return for one prompt (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None  # None while unfinished or after an error
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    user: str | None = field(default=None, repr=False)
