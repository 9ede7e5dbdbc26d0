"""The config's plugins resolved once: every plugin the config selects looked up in the
registry and its settings validated, in one typed record the components are built from.

``resolve_plugins`` runs the start-up check (``baton.plugins.check``); a process resolves
once (the frontend in ``LLM`` / ``AsyncLLM``, an engine process when it starts) and hands
each component the plugin it needs (``ResolvedPlugins.one("transport")``) instead of the
component looking it up again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from baton.config import BatonConfig
from baton.errors import PluginError
from baton.plugins.check import combined, find_chosen_plugins
from baton.plugins.kinds import PLUGIN_KINDS
from baton.plugins.registry import ChosenPlugin, Registry, get_registry


@dataclass(frozen=True)
class ResolvedPlugins:
    """The plugins one config selects, each with its validated settings."""

    registry: Registry
    """The registry they were resolved from (its ``fingerprint`` goes to spawned processes)."""
    chosen: tuple[ChosenPlugin, ...]
    """In ``PLUGIN_KINDS`` order; a list selector's names in the config's order."""
    skipped: frozenset[str] = frozenset()
    """Kinds the caller supplies itself (an executor instance), not resolved."""

    def all(self, kind: str) -> list[ChosenPlugin]:
        """Every chosen plugin of ``kind`` (``stat_logger``: the configured list)."""
        return [c for c in self.chosen if c.entry.kind == kind]

    def find(self, kind: str) -> ChosenPlugin | None:
        """The chosen plugin of ``kind``; None when the config selects none (``speculative.method
        = 'none'``, no structured-output backend installed)."""
        found = self.all(kind)
        return found[0] if found else None

    def factories(self, kind: str, config: BatonConfig) -> list[Callable[..., Any]]:
        """Every chosen plugin of ``kind`` as its factory with ``config`` and its settings bound
        (called with the kind's other arguments): what a component building them takes instead
        of the config."""
        return [functools.partial(c.create, config) for c in self.all(kind)]

    def one(self, kind: str) -> ChosenPlugin:
        """The chosen plugin of a kind the config always selects (``transport``, ``router``)."""
        found = self.find(kind)
        if found is None:
            why = "the caller supplies it" if kind in self.skipped else "the config selects none"
            raise PluginError(
                f"no {PLUGIN_KINDS[kind].word} was resolved ({why}): resolve the config "
                f"without skipping {kind!r}"
            )
        return found


def resolve_plugins(
    config: BatonConfig,
    registry: Registry | None = None,
    skip: frozenset[str] = frozenset(),
    given: Sequence[ChosenPlugin] = (),
) -> ResolvedPlugins:
    """Pick every plugin ``config`` selects and validate its settings, or raise one error
    listing every problem (``check_config_plugins``'s checks and errors). ``registry``: the
    process's (``get_registry()``) unless given; ``skip``: kinds the caller supplies itself;
    ``given``: selected plugins the caller resolved already (an engine process resolves its
    transport first, to report the rest's errors through it), kept, not validated again."""
    registry = registry if registry is not None else get_registry()
    chosen, errors = find_chosen_plugins(config, registry, skip, given)
    if errors:
        raise combined(errors)
    return ResolvedPlugins(registry, tuple(chosen), skip)
