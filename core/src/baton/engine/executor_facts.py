"""What the core reads from its executor about the loaded model: ``model_info`` and
``model_capabilities`` (members of ``baton.interfaces.Executor``).

An executor written before they were members may lack them: it still runs (the
core reads the model folder and restricts nothing), with a DeprecationWarning
naming the executor and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

from baton.errors import ExecutorError
from baton.protocol import ModelCapabilities, ModelInfo


def _member(executor: Any, name: str) -> Any:
    if hasattr(executor, name):
        return getattr(executor, name)
    warnings.warn(
        f"executor {type(executor).__qualname__} has no {name!r} attribute, a member of "
        f"baton.interfaces.Executor; set {name} = None when it loads no model (required "
        "from the next plugin API version)",
        DeprecationWarning,
        stacklevel=3,
    )
    return None


def executor_model_info(executor: Any) -> ModelInfo | None:
    """The executor's ``model_info``: a ModelInfo, or None when it loads no model."""
    info = _member(executor, "model_info")
    if info is not None and not isinstance(info, ModelInfo):
        raise ExecutorError(
            f"executor {type(executor).__qualname__}.model_info is a {type(info).__name__}, "
            "not a baton.protocol.ModelInfo (or None)"
        )
    return info


def executor_capabilities(executor: Any) -> ModelCapabilities | None:
    """The executor's ``model_capabilities``: a ModelCapabilities, or None (no restriction)."""
    caps = _member(executor, "model_capabilities")
    if isinstance(caps, tuple) and len(caps) == 3:  # the tuple executors reported before
        warnings.warn(
            f"executor {type(executor).__qualname__}.model_capabilities is a tuple; "
            "return a baton.protocol.ModelCapabilities",
            DeprecationWarning,
            stacklevel=2,
        )
        return ModelCapabilities(
            supports_chunked_prefill=bool(caps[0]),
            supports_prefix_caching=bool(caps[1]),
            reason=str(caps[2]),
        )
    if caps is not None and not isinstance(caps, ModelCapabilities):
        raise ExecutorError(
            f"executor {type(executor).__qualname__}.model_capabilities is a "
            f"{type(caps).__name__}, not a baton.protocol.ModelCapabilities (or None)"
        )
    return caps
