"""baton: a plugin-first LLM inference engine.

``from baton import LLM, SamplingParams`` for offline use; ``AsyncLLM`` for
asyncio serving; ``hookimpl`` to write a plugin. Heavy modules load lazily so
that ``import baton`` (and the CLI's start-up) stays fast.
"""

from typing import TYPE_CHECKING, Any

from baton import config_sections
from baton.plugins.hookspecs import PLUGIN_API_VERSION, hookimpl
from baton.pooling_params import PoolingParams
from baton.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputSpec
from baton.scheduling_info import SchedulingInfo

__version__ = "0.1.0"

_LAZY = {
    "LLM": "baton.frontend.llm",
    "AsyncLLM": "baton.frontend.async_llm",
    "RequestOutput": "baton.outputs",
    "CompletionOutput": "baton.outputs",
    "Logprob": "baton.outputs",
    "PoolingOutput": "baton.outputs",
    "PoolingRequestOutput": "baton.outputs",
    "BatonConfig": "baton.config",
    "EngineCore": "baton.engine.core",
    "LoRARequest": "baton.lora.request",
    "BeamSearchParams": "baton.beam_search",
    "BeamSearchOutput": "baton.beam_search",
    "BeamSearchSequence": "baton.beam_search",
}

if TYPE_CHECKING:
    from baton.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from baton.config import BatonConfig
    from baton.engine.core import EngineCore
    from baton.frontend.async_llm import AsyncLLM
    from baton.frontend.llm import LLM
    from baton.lora.request import LoRARequest
    from baton.outputs import (
        CompletionOutput,
        Logprob,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
    )


def _plugin_config_sections() -> dict[str, Any]:
    """The config sections installed plugins register (the config's provider)."""
    # start-up cost: the registry loads the plugins on first use, not at ``import baton``
    from baton.plugins.registry import get_registry

    return get_registry().config_sections()


config_sections.set_provider(_plugin_config_sections)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'baton' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "PLUGIN_API_VERSION",
    "AsyncLLM",
    "BatonConfig",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineCore",
    "LoRARequest",
    "Logprob",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulingInfo",
    "StructuredOutputSpec",
    "__version__",
    "hookimpl",
]
