"""Old import paths of public modules that moved, kept through the deprecation period.

docs/stability.md: a public name keeps working for at least one further minor release after
it is deprecated, and warns (``DeprecationWarning``) naming its replacement and the release
that removes it. A moved module's old path is a module whose ``__getattr__`` is
``forward(old, new)``; a module whose names left the public list (the objects stay, under an
internal name, there or in the module ``home`` now holding them) has
``retired(module, names, home=...)``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
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


def retired(
    module: str, names: Mapping[str, tuple[str, str]], *, home: str | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``'s names that left the public list.

    ``names``: each retired name -> (the internal name of the same object, what to use
    instead), found in ``home`` (default: ``module`` itself). The old name keeps working
    until ``REMOVED_IN``, with a warning."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        internal, instead = names[name]
        warnings.warn(
            f"{module}.{name} is no longer public and is removed in baton {REMOVED_IN}: {instead}",
            DeprecationWarning,
            stacklevel=2,
        )
        holder = sys.modules[module] if home is None else importlib.import_module(home)
        return getattr(holder, internal)

    return __getattr__
