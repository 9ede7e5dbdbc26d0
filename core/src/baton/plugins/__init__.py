"""baton's plugin machinery, in one package.

- ``hookspecs``: the plugin contract, one registration hook per extension point
  (``hookimpl``, ``PLUGIN_API_VERSION``; also ``from baton import hookimpl``).
- ``kinds``: one record per plugin kind (``PLUGIN_KINDS``) and the factory protocols.
- ``registry``: entry-point discovery and the registry of what plugins provide.
- ``check``: the config's plugins, checked before anything loads.
- ``public_api``: the one list of names a plugin may import.

``get_registry``, ``Registry`` and ``PluginEntry`` (public) are reachable here too; they load
on first use so that ``import baton`` stays light (the registry imports pydantic and the
entry-point machinery).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from baton.plugins.registry import PluginEntry, Registry, get_registry

#: The package's public names and the module that defines each.
_PUBLIC = {
    "get_registry": "baton.plugins.registry",
    "Registry": "baton.plugins.registry",
    "PluginEntry": "baton.plugins.registry",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'baton.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["PluginEntry", "Registry", "get_registry"]
