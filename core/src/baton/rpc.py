"""What ``collective_rpc`` from ``LLM`` / ``AsyncLLM`` may call on every worker.

Two kinds of targets, nothing else (no attribute of the worker is reachable by name):

- the ``Worker`` methods on the allow-list ``WORKER_RPC_METHODS`` (read-only facts);
- functions registered by name with ``register_worker_rpc(name)``, called as
  ``fn(worker, *args, **kwargs)`` (``worker.model_runner`` is the runner). A worker knows the
  names registered in its own process: register at import of a module every process imports
  (a plugin's module: plugins load in every process baton spawns).

A target's exception fails that call (the error names the rank), not the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from baton.errors import InvalidRequestError, PluginError

#: Worker methods collective_rpc may call by name.
WORKER_RPC_METHODS = frozenset(
    {"memory_usage", "get_model_info", "get_model_capabilities", "get_kv_cache_spec"}
)

F = TypeVar("F", bound=Callable[..., Any])
_registered: dict[str, Callable[..., Any]] = {}


def register_worker_rpc(name: str) -> Callable[[F], F]:
    """A decorator: ``fn(worker, *args, **kwargs)`` answers ``collective_rpc(name, ...)``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise PluginError(f"worker rpc name {name!r}: use a Python identifier, e.g. 'my_stats'")
    if name in WORKER_RPC_METHODS:
        raise PluginError(f"worker rpc name {name!r} is a Worker method already; pick another")

    def register(fn: F) -> F:
        known = _registered.get(name)
        if known is not None and known is not fn:
            raise PluginError(
                f"worker rpc name {name!r} is registered already, by "
                f"{known.__module__}.{known.__qualname__}; pick another name"
            )
        _registered[name] = fn
        return fn

    return register


def worker_rpc_names() -> list[str]:
    """Every name collective_rpc can call in this process: the allow-list and the registered."""
    return sorted(WORKER_RPC_METHODS | set(_registered))


def _call_method(worker: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    return getattr(worker, name)(*args, **kwargs)  # AttributeError: a worker without it


def run_worker_rpc(
    worker: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    """In a worker (a ``baton.interfaces.Worker``): ``(True, result)`` of the named target, or
    ``(False, "Type: message")`` (the engine's ``collective_rpc`` raises it, naming the rank)."""
    if name in WORKER_RPC_METHODS:
        fn: Callable[..., Any] = functools.partial(_call_method, worker, name)
    elif name in _registered:
        fn = functools.partial(_registered[name], worker)
    else:
        error = InvalidRequestError(
            f"collective_rpc method {name!r} is neither a Worker method on the allow-list nor "
            f"registered in this worker (known: {', '.join(worker_rpc_names())}); register it "
            "with baton.rpc.register_worker_rpc in a module every process imports",
            param="method",
        )
        return False, f"{type(error).__name__}: {error}"
    try:
        return True, fn(*args, **kwargs)
    except Exception as e:  # the caller gets it; the worker and the engine go on
        return False, f"{type(e).__name__}: {e}"
