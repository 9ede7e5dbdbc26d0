"""The registry of tool-call and reasoning parsers: built-ins and the ``baton_openai`` entry points.

``ParserRegistry.load()`` registers the built-ins (``hermes``, ``json``; ``think``)
and every module of the ``baton_openai`` entry-point group (none with
``BATON_DISABLE_PLUGIN_AUTOLOAD=1``), then runs the registration hooks. A name
registered twice, or a selected name nobody registered, is a ConfigError naming
what is installed.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from baton.errors import ConfigError
from baton_openai import hookspecs
from baton_openai.hookspecs import hookimpl
from baton_openai.parsing.reasoning import ThinkReasoningParser
from baton_openai.parsing.tool_parsers import HermesToolParser, JsonToolParser
from baton_openai.parsing.types import ReasoningParser, ToolParser

log = logging.getLogger("baton_openai")
BUILTIN = "baton-plugin-openai"


@dataclass(frozen=True)
class ParserEntry:
    name: str
    factory: Callable[[Any], Any]
    distribution: str


@dataclass
class ParserRegistry:
    """Parsers by kind ("tool" or "reasoning") and name."""

    entries: dict[str, dict[str, ParserEntry]] = field(
        default_factory=lambda: {"tool": {}, "reasoning": {}}
    )

    @classmethod
    def load(
        cls, extra: list[object] | None = None, autoload: bool | None = None
    ) -> ParserRegistry:
        """Built-ins, the entry points (unless autoload is off) and ``extra`` plugin objects."""
        if autoload is None:
            off = os.environ.get("BATON_DISABLE_PLUGIN_AUTOLOAD", "").lower()
            autoload = off not in ("1", "true", "yes")
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        dists = {"builtin": BUILTIN}
        pm.register(_Builtins(), name="builtin")
        if autoload:
            for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
                if pm.has_plugin(ep.name):
                    continue
                dist = ep.dist.name if ep.dist else "unknown"
                try:
                    pm.register(ep.load(), name=ep.name)
                except Exception as e:  # a broken plugin must not take the server down
                    log.error("parser plugin %s (%s) failed to load: %s", ep.name, dist, e)
                    continue
                dists[ep.name] = dist
        for i, plugin in enumerate(extra or []):
            pm.register(plugin, name=f"extra-{i}")
            dists[f"extra-{i}"] = "local"
        registry = cls()
        for kind, hook in (
            ("tool", pm.hook.register_tool_parsers),
            ("reasoning", pm.hook.register_reasoning_parsers),
        ):
            for impl in hook.get_hookimpls():
                dist = dists.get(impl.plugin_name, "unknown")
                impl.function(register=registry._registrar(kind, dist))
        return registry

    def _registrar(self, kind: str, dist: str) -> Callable[[str, Callable[[Any], Any]], None]:
        def register(name: str, factory: Callable[[Any], Any]) -> None:
            known = self.entries[kind]
            if name in known:
                raise ConfigError(
                    f"{kind} parser {name!r} is registered by both {known[name].distribution} "
                    f"and {dist}: uninstall one"
                )
            if not callable(factory):
                raise ConfigError(
                    f"{kind} parser {name!r} from {dist}: the factory is not callable"
                )
            known[name] = ParserEntry(name, factory, dist)

        return register

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def _entry(self, kind: str, name: str, setting: str) -> ParserEntry:
        entry = self.entries[kind].get(name)
        if entry is None:
            raise ConfigError(
                f"{setting} = {name!r}: no such {kind} parser; installed: "
                f"{', '.join(self.names(kind))}"
            )
        return entry

    def check(self, tool: str, reasoning: str | None) -> None:
        """ConfigError unless both selected names are registered."""
        self._entry("tool", tool, "server.tool_call_parser")
        if reasoning is not None:
            self._entry("reasoning", reasoning, "server.reasoning_parser")

    def create(self, kind: str, name: str, setting: str, tokenizer: Any) -> Any:
        return self._entry(kind, name, setting).factory(tokenizer)

    def tool_parser(self, name: str, tokenizer: Any = None) -> ToolParser:
        return self.create("tool", name, "server.tool_call_parser", tokenizer)  # type: ignore[no-any-return]

    def reasoning_parser(self, name: str | None, tokenizer: Any = None) -> ReasoningParser | None:
        if name is None:
            return None
        return self.create("reasoning", name, "server.reasoning_parser", tokenizer)  # type: ignore[no-any-return]


class _Builtins:
    """baton-plugin-openai's own parsers."""

    @hookimpl
    def register_tool_parsers(self, register: hookspecs.ParserRegister) -> None:
        register("hermes", HermesToolParser)
        register("json", JsonToolParser)

    @hookimpl
    def register_reasoning_parsers(self, register: hookspecs.ParserRegister) -> None:
        register("think", ThinkReasoningParser)
