"""Plugin discovery and the registry of everything plugins provide.

One pluggy PluginManager (project ``baton``) loads the ``baton`` entry-point
group; baton-core's built-ins come through the same group. Registration hooks
fill a ``Registry`` keyed by (kind, name). Environment switches:
``BATON_PLUGINS`` (comma-separated allowlist of entry-point or distribution
names; baton-core's built-ins are always loaded), ``BATON_DISABLE_PLUGIN_AUTOLOAD``
(load only baton-core's built-ins), ``BATON_TRACE_PLUGINS`` (log every hook call).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import importlib_metadata
import pluggy
from pydantic import BaseModel

from baton.config.sections import SECTIONS
from baton.errors import DuplicatePluginError, PluginError, PluginLoadError, PluginNotFoundError
from baton.plugins import hookspecs
from baton.plugins.kinds import BY_HOOK, PLUGIN_KINDS, PluginKind, kind_word

if TYPE_CHECKING:
    from baton.config import BatonConfig

log = logging.getLogger(__name__)

GROUP = "baton"
CORE_DIST = "baton-core"

#: hook name -> the kind of thing it registers (from baton.plugins.kinds)
KINDS = {k.hook: k.name for k in PLUGIN_KINDS.values()}
#: Where a missing name that baton-core does not provide comes from, for the "pip install ..." hint.
KNOWN_DISTRIBUTIONS = {
    (k.name, name): dist for k in PLUGIN_KINDS.values() for name, dist in k.distributions.items()
}


@dataclass(frozen=True)
class PluginEntry:
    """One registered name: what provides it and how to build it."""

    kind: str
    name: str
    factory: Callable[..., Any]
    settings_model: type[BaseModel] | None
    plugin: str  # the pluggy plugin (entry-point) name
    distribution: str
    version: str

    def create(self, *args: Any, **kwargs: Any) -> Any:
        """Call the factory; an exception names the plugin and its distribution."""
        try:
            return self.factory(*args, **kwargs)
        except PluginError:
            raise
        except Exception as e:
            raise PluginError(f"{self.describe()} failed to start: {type(e).__name__}: {e}") from e

    def settings(self, config: BatonConfig) -> BaseModel | None:
        """This plugin's validated ``[<section>.<name>]`` table (the section from its kind's
        record in ``PLUGIN_KINDS``); None for a plugin without a settings model."""
        section = PLUGIN_KINDS[self.kind].section
        if section is None:
            return None
        return config.plugin_settings(section, self.name, self.settings_model)

    def describe(self) -> str:
        return f"{kind_word(self.kind)} {self.name!r} (plugin {self.plugin!r} from {self.distribution} {self.version})"


@dataclass(frozen=True)
class ChosenPlugin:
    """A plugin the config selects, with its settings validated once (``baton.plugins.resolve``)."""

    entry: PluginEntry
    settings: BaseModel | None

    @property
    def name(self) -> str:
        return self.entry.name

    def create(self, config: BatonConfig, *args: Any) -> Any:
        """Build its product: ``factory(config, settings, *args)`` (the kind's factory protocol)."""
        return self.entry.create(config, self.settings, *args)


@dataclass
class Registry:
    entries: dict[tuple[str, str], PluginEntry] = field(default_factory=dict)
    #: plugins that failed to load: (plugin name, distribution, reason)
    failed: list[tuple[str, str, str]] = field(default_factory=list)

    def get(self, kind: str, name: str) -> PluginEntry:
        """Look a name up; a miss says what is installed and what to install."""
        entry = self.entries.get((kind, name))
        if entry is not None:
            return entry
        installed = ", ".join(self.names(kind)) or "none"
        record = PLUGIN_KINDS.get(kind)
        hint = record.install_hint(name) if record else "install the distribution that provides it"
        msg = f"{kind_word(kind)} {name!r} is not installed (installed: {installed}). {hint}"
        if self.failed:
            msg += "; plugins that failed to load: " + "; ".join(
                f"{p} ({d}): {r}" for p, d, r in self.failed
            )
        raise PluginNotFoundError(msg)

    def names(self, kind: str) -> list[str]:
        return sorted(n for k, n in self.entries if k == kind)

    def of_kind(self, kind: str) -> list[PluginEntry]:
        return [self.entries[(kind, n)] for n in self.names(kind)]

    def config_sections(self) -> dict[str, type[BaseModel]]:
        """The top-level config sections plugins register: name -> its settings model."""
        return {e.name: e.factory for e in self.of_kind("config_section")}  # type: ignore[misc]

    def fingerprint(self) -> list[tuple[str, str, str, str]]:
        """What a spawned process must also see: (kind, name, distribution, version)."""
        return sorted((e.kind, e.name, e.distribution, e.version) for e in self.entries.values())


class _Registrar:
    """The ``register`` callback one plugin's hook gets: checks and records its names."""

    def __init__(
        self, reg: Registry, kind: PluginKind, plugin: str, distribution: str, version: str
    ) -> None:
        self.reg, self.kind, self.plugin = reg, kind, plugin
        self.distribution, self.version = distribution, version

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        settings_model: type[BaseModel] | None = None,
    ) -> None:
        where = f"plugin {self.plugin!r} from {self.distribution} in {self.kind.hook}"
        if not isinstance(name, str) or not name:
            raise PluginLoadError(f"{where}: a name must be a non-empty string, got {name!r}")
        if not callable(factory):
            raise PluginLoadError(
                f"{where}: the factory of {self.kind.word} {name!r} is not callable: {factory!r}"
            )
        if self.kind.name == "config_section":
            _check_config_section(where, name, factory)
        if settings_model is not None:
            if not (isinstance(settings_model, type) and issubclass(settings_model, BaseModel)):
                raise PluginLoadError(
                    f"{where}: the settings model of {self.kind.word} {name!r} must be a "
                    f"pydantic BaseModel subclass, got {settings_model!r}"
                )
            if not self.kind.takes_settings:
                raise PluginLoadError(
                    f"{where}: {self.kind.word} {name!r} registers a settings model, but "
                    f"{self.kind.word}s are not configured (no config sub-table): drop it"
                )
        old = self.reg.entries.get((self.kind.name, name))
        if old is not None:
            raise DuplicatePluginError(
                f"{self.kind.word} {name!r} is registered twice: by plugin {old.plugin!r} from "
                f"{old.distribution} and by plugin {self.plugin!r} from {self.distribution}; "
                "uninstall one of them"
            )
        self.reg.entries[(self.kind.name, name)] = PluginEntry(
            self.kind.name,
            name,
            factory,
            settings_model,
            self.plugin,
            self.distribution,
            self.version,
        )


def _check_config_section(where: str, name: str, model: Any) -> None:
    """A registered config section is a pydantic model under a name baton-core's sections and
    the config's keyword forms do not use."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginLoadError(
            f"{where}: config section {name!r} must be a pydantic BaseModel subclass, got {model!r}"
        )
    if name in SECTIONS or not name.isidentifier():
        raise PluginLoadError(
            f"{where}: config section {name!r} is baton-core's or not an identifier: "
            "register it under a name of its own (letters, digits, _)"
        )


class Plugins:
    """The PluginManager plus the registry built from its registration hooks."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self._dists: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self._registry: Registry | None = None
        self._failed: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def load_entry_points(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        allow = {s.strip() for s in env.get("BATON_PLUGINS", "").split(",") if s.strip()}
        autoload = env.get("BATON_DISABLE_PLUGIN_AUTOLOAD", "").lower() not in ("1", "true", "yes")
        for ep in importlib_metadata.entry_points(group=GROUP):
            dist = ep.dist.name if ep.dist else "unknown"
            version = ep.dist.version if ep.dist else "0"
            essential = dist == CORE_DIST
            if not essential and (
                not autoload or ("BATON_PLUGINS" in env and not allow & {ep.name, dist})
            ):
                log.debug("plugin %s from %s not loaded (allowlist / autoload off)", ep.name, dist)
                continue
            if self.pm.has_plugin(ep.name) or ep.name in self._dists:
                continue  # the same distribution seen twice on sys.path
            try:
                module = ep.load()
            except Exception as e:  # a broken plugin must not take the others down
                self._fail(ep.name, dist, f"failed to import {ep.value!r}: {type(e).__name__}: {e}")
                continue
            self.register(module, ep.name, dist, version)

    def register(
        self, plugin: object, name: str, distribution: str = "local", version: str = "0"
    ) -> None:
        """Register a module or object of @hookimpl functions (also for tests)."""
        api = getattr(plugin, "BATON_PLUGIN_API", hookspecs.PLUGIN_API_VERSION)
        supported = set(api) if isinstance(api, list | tuple | set) else {api}
        if hookspecs.PLUGIN_API_VERSION not in supported:
            self._fail(
                name,
                distribution,
                f"built for baton plugin API {sorted(supported)}, this baton speaks "
                f"{hookspecs.PLUGIN_API_VERSION}: upgrade the plugin or baton",
            )
            return
        try:
            self.pm.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as e:
            self._fail(name, distribution, f"invalid plugin: {e}")
            return
        self._dists[name] = (distribution, version)
        self._registry = None

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._dists.pop(name, None)
        self._registry = None

    def _fail(self, name: str, dist: str, reason: str) -> None:
        log.error("baton plugin %r from %s refused: %s", name, dist, reason)
        self._failed.append((name, dist, reason))

    @property
    def registry(self) -> Registry:
        with self._lock:
            if self._registry is None:
                self._registry = self._collect()
            return self._registry

    def _collect(self) -> Registry:
        reg = Registry(failed=list(self._failed))
        trace = bool(os.environ.get("BATON_TRACE_PLUGINS"))
        for hook_name, kind in BY_HOOK.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                dist, version = self._dists.get(impl.plugin_name, ("local", "0"))
                register = _Registrar(reg, kind, impl.plugin_name, dist, version)
                if trace:
                    log.warning(
                        "baton hook %s -> plugin %r (%s)", hook_name, impl.plugin_name, dist
                    )
                try:
                    impl.function(register=register)
                except PluginError:
                    raise
                except Exception as e:
                    raise PluginLoadError(
                        f"plugin {impl.plugin_name!r} from {dist} raised in {hook_name}: {type(e).__name__}: {e}"
                    ) from e
        return reg

    def plugin_modules(self) -> Iterable[tuple[str, ModuleType | object]]:
        return self.pm.list_name_plugin()


_plugins: Plugins | None = None
_plugins_lock = threading.Lock()


def get_plugins() -> Plugins:
    """The process-wide plugin manager, loaded from entry points on first use."""
    global _plugins
    with _plugins_lock:
        if _plugins is None:
            plugins = Plugins()
            plugins.load_entry_points()
            _plugins = plugins
        return _plugins


def get_registry() -> Registry:
    return get_plugins().registry


def reset_plugins() -> None:
    """Forget the loaded plugins; the next get_plugins() loads entry points again."""
    global _plugins
    with _plugins_lock:
        _plugins = None
