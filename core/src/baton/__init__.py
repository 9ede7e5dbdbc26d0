"""baton: a plugin-first LLM inference engine."""

from baton.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputSpec

__version__ = "0.1.0"

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputSpec", "__version__"]
