"""The top-level config sections plugins register (``register_config_sections``), as the
config sees them.

``baton.config`` sits below the plugin machinery, so it cannot ask the registry itself:
baton's package ``__init__`` connects the two once (``set_provider``), and the config asks
``registered()`` whenever it builds a ``BatonConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel

#: Returns ``{section name: its settings model}`` for every installed plugin section.
Provider = Callable[[], Mapping[str, "type[BaseModel]"]]

_provider: Provider | None = None


def set_provider(provider: Provider) -> None:
    """Where ``registered()`` reads the plugin sections from (baton's ``__init__`` sets it)."""
    global _provider
    _provider = provider


def registered() -> Mapping[str, type[BaseModel]]:
    """The sections installed plugins register, in registration order; {} before any provider."""
    return {} if _provider is None else _provider()
