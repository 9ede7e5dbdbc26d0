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
from typing import Any, Protocol

import importlib_metadata
import pluggy
from pydantic import BaseModel

from baton import hookspecs
from baton.errors import DuplicatePluginError, PluginError, PluginLoadError, PluginNotFoundError

log = logging.getLogger(__name__)

GROUP = "baton"
CORE_DIST = "baton-core"

#: hook name -> the kind of thing it registers
KINDS = {
    "register_scheduler_policies": "scheduler_policy",
    "register_executors": "executor",
    "register_transports": "transport",
    "register_structured_output_backends": "structured_output",
    "register_stat_loggers": "stat_logger",
    "register_commands": "command",
}
_KIND_WORDS = {
    "scheduler_policy": "scheduler policy",
    "structured_output": "structured-output backend",
}
#: Where a missing first-party name comes from, for the "pip install ..." hint.
KNOWN_DISTRIBUTIONS = {
    ("transport", "zmq"): "baton-plugin-zmq",
    ("transport", "shm"): "baton-plugin-shm",
    ("executor", "cuda"): "baton-plugin-cuda",
    ("executor", "cuda-tp"): "baton-plugin-cuda-tp",
    ("executor", "pipeline"): "baton-plugin-pipeline",
    ("structured_output", "xgrammar"): "baton-plugin-xgrammar",
    ("command", "serve"): "baton-plugin-openai",
    ("stat_logger", "prometheus"): "baton-plugin-openai",
    ("scheduler_policy", "sjf"): "baton-contrib-sjf",
    ("scheduler_policy", "fair"): "baton-contrib-fair",
}


class RegisterFn(Protocol):
    def __call__(
        self, name: str, factory: Callable[..., Any], settings_model: type[BaseModel] | None = None
    ) -> None: ...


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

    def describe(self) -> str:
        return f"{_KIND_WORDS.get(self.kind, self.kind)} {self.name!r} (plugin {self.plugin!r} from {self.distribution} {self.version})"


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
        dist = KNOWN_DISTRIBUTIONS.get((kind, name))
        hint = f"pip install {dist}" if dist else "install the distribution that provides it"
        msg = f"{_KIND_WORDS.get(kind, kind)} {name!r} is not installed (installed: {installed}). {hint}"
        if self.failed:
            msg += "; plugins that failed to load: " + "; ".join(
                f"{p} ({d}): {r}" for p, d, r in self.failed
            )
        raise PluginNotFoundError(msg)

    def names(self, kind: str) -> list[str]:
        return sorted(n for k, n in self.entries if k == kind)

    def of_kind(self, kind: str) -> list[PluginEntry]:
        return [self.entries[(kind, n)] for n in self.names(kind)]

    def fingerprint(self) -> list[tuple[str, str, str, str]]:
        """What a spawned process must also see: (kind, name, distribution, version)."""
        return sorted((e.kind, e.name, e.distribution, e.version) for e in self.entries.values())


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
        for hook_name, kind in KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                dist, version = self._dists.get(impl.plugin_name, ("local", "0"))

                def register(
                    name: str,
                    factory: Callable[..., Any],
                    settings_model: type[BaseModel] | None = None,
                    _plugin: str = impl.plugin_name,
                    _dist: str = dist,
                    _version: str = version,
                    _kind: str = kind,
                ) -> None:
                    entry = PluginEntry(
                        _kind, name, factory, settings_model, _plugin, _dist, _version
                    )
                    old = reg.entries.get((_kind, name))
                    if old is not None:
                        raise DuplicatePluginError(
                            f"{_KIND_WORDS.get(_kind, _kind)} {name!r} is registered twice: by plugin "
                            f"{old.plugin!r} from {old.distribution} and by plugin {_plugin!r} from {_dist}; "
                            "uninstall one of them"
                        )
                    reg.entries[(_kind, name)] = entry

                if trace:
                    log.warning(
                        "baton hook %s -> plugin %r (%s)", hook_name, impl.plugin_name, dist
                    )
                try:
                    impl.function(register=register)
                except DuplicatePluginError:
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
