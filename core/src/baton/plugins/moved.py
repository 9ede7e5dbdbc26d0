"""Old import paths of public modules that moved, kept through the deprecation period.

docs/stability.md: a public name keeps working for at least one further minor release after
it is deprecated, and warns (``DeprecationWarning``) naming its replacement and the release
that removes it. A moved module's old path is a module whose ``__getattr__`` is
``forward(old, new)``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

#: The release that removes the old paths (on 0.x a minor release is a major one).
REMOVED_IN = "0.3.0"


def forward(old: str, new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``: each public name comes from ``new``, with a warning."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # import machinery probes (__path__, __file__): not moved names
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        target = importlib.import_module(new)
        if not hasattr(target, name):
            raise AttributeError(f"module {old!r} has no attribute {name!r} (moved to {new!r})")
        warnings.warn(
            f"{old}.{name} moved to {new}.{name}; the old path is removed in baton "
            f"{REMOVED_IN}: import it from {new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(target, name)

    return __getattr__
