"""One record per plugin kind: everything the kernel knows about a kind of plugin.

The registry (``baton.plugins.registry``: hook -> kind, display words, install hints),
config selection (``baton.config``: which section field names the plugin, which
sub-tables are plugin settings), the start-up check
(``baton.plugins.check``) and the kind list in docs/hooks.md all derive
from ``PLUGIN_KINDS``; ``python -m baton.plugins.kinds`` prints that list.

The factory protocols say what each hook's ``register`` takes; ``Register[F]`` is
the ``register`` callback of a hook whose factories are ``F``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from baton import interfaces

if TYPE_CHECKING:
    from pydantic import BaseModel

    from baton.config import BatonConfig
    from baton.kv_transfer.connector import KVConnector


# --------------------------------------------------------------------------- factory protocols


class SchedulerPolicyFactory(Protocol):
    """``factory(config, settings)``: a policy, once per engine core (engine process)."""

    def __call__(self, config: BatonConfig, settings: Any, /) -> interfaces.SchedulerPolicy: ...


class ExecutorFactory(Protocol):
    """``factory(config, settings)``: an executor, once, in the engine process."""

    def __call__(self, config: BatonConfig, settings: Any, /) -> interfaces.Executor: ...


class EngineLauncherFactory(Protocol):
    """``factory(config, settings)``: an engine launcher, once per frontend client (frontend process)."""

    def __call__(self, config: BatonConfig, settings: Any, /) -> interfaces.EngineLauncher: ...


class TransportFactory(Protocol):
    """``factory(config, settings)``: a transport, in the frontend and in the engine process."""

    def __call__(self, config: BatonConfig, settings: Any, /) -> interfaces.Transport: ...


class StructuredOutputFactory(Protocol):
    """``factory(config, settings, tokenizer, vocab_size)``: a grammar backend, on first use."""

    def __call__(
        self, config: BatonConfig, settings: Any, tokenizer: Any, vocab_size: int, /
    ) -> interfaces.StructuredOutputBackend: ...


class StatLoggerFactory(Protocol):
    """``factory(config, settings, engine_index)``: a stat logger, when an LLM / AsyncLLM starts."""

    def __call__(
        self, config: BatonConfig, settings: Any, engine_index: int, /
    ) -> interfaces.StatLogger: ...


class SpeculatorFactory(Protocol):
    """``factory(config, settings)``: a speculator, once per engine core (engine process)."""

    def __call__(self, config: BatonConfig, settings: Any, /) -> interfaces.Speculator: ...


class KVConnectorFactory(Protocol):
    """``factory(config, settings)``: a KV connector (``baton.kv_transfer.connector.KVConnector``),
    once in the engine process (for its scheduler half) and once in each worker process (for
    that worker's half)."""

    def __call__(self, config: BatonConfig, settings: Any, /) -> KVConnector: ...


class RouterFactory(Protocol):
    """``factory(config, settings)``: a router, once per frontend client with several engines."""

    def __call__(self, config: BatonConfig, settings: Any, /) -> interfaces.Router: ...


#: What a command's factory returns: ``handler(args) -> exit status or None``.
CommandHandler = Callable[[argparse.Namespace], int | None]


class CommandFactory(Protocol):
    """``factory(parser)``: adds the command's arguments, returns its handler (CLI start-up)."""

    def __call__(self, parser: argparse.ArgumentParser, /) -> CommandHandler: ...


class BenchFactory(Protocol):
    """``factory(parser)``: adds the benchmark's arguments, returns its handler (CLI start-up)."""

    def __call__(self, parser: argparse.ArgumentParser, /) -> CommandHandler: ...


class ConfigSectionModel(Protocol):
    """``register(name, model)``: a pydantic model class, the config's top-level ``[<name>]``
    table (validated whenever a ``BatonConfig`` is built; ``config.<name>`` is an instance;
    called with no arguments: the section's defaults)."""

    def __call__(self) -> BaseModel: ...


F_contra = TypeVar("F_contra", contravariant=True)


class Register(Protocol[F_contra]):
    """The callback a registration hook receives: ``register(name, factory, settings_model=None)``."""

    def __call__(
        self, name: str, factory: F_contra, settings_model: type[BaseModel] | None = None
    ) -> None: ...


# --------------------------------------------------------------------------- the record


@dataclass(frozen=True, eq=False)
class PluginKind:
    """What the kernel knows about one kind of plugin."""

    name: str
    """The kind as the registry and ``baton plugins`` name it (``scheduler_policy``)."""
    hook: str
    """The registration hook (``register_scheduler_policies``)."""
    word: str
    """How messages name one of them (``scheduler policy``)."""
    factory: type
    """The factory protocol ``register`` takes."""
    product: type | None
    """The protocol in ``baton.interfaces`` the factory's product implements (None: commands and
    benchmarks, whose factories return a CLI handler, and KV connectors, whose protocols live
    in ``baton.kv_transfer.connector``, a layer above ``baton.interfaces``)."""
    section: str | None = None
    """The config section that selects it and holds its ``[<section>.<name>]`` settings
    sub-tables; None: not configured (no settings model allowed)."""
    selector: str | None = None
    """The field of ``section`` that names the plugin (or, with ``many``, the list of them)."""
    many: bool = False
    """The selector is a list: several run at once."""
    unselected: frozenset[str] = frozenset()
    """Selector values that name no plugin (``auto``, ``none``)."""
    builtin: tuple[str, ...] = ()
    """Names baton-core registers."""
    distributions: Mapping[str, str] = field(default_factory=dict)
    """Name -> the distribution that provides it, for names outside baton-core (install hints)."""

    @property
    def takes_settings(self) -> bool:
        """Whether a plugin of this kind may register a settings model (it has a sub-table)."""
        return self.section is not None

    def selected(self, config: BatonConfig) -> list[str]:
        """The names ``config`` selects (``unselected`` values left out); [] when not configured."""
        if self.section is None or self.selector is None:
            return []
        value = getattr(getattr(config, self.section), self.selector)
        names = list(value) if self.many else [value]
        return [n for n in names if n not in self.unselected]

    def selector_path(self) -> str:
        """``section.field`` of the selector, for messages and docs."""
        return f"{self.section}.{self.selector}" if self.section else "-"

    def install_hint(self, name: str) -> str:
        """What to do about a missing ``name`` of this kind."""
        dist = self.distributions.get(name)
        return f"pip install {dist}" if dist else "install the distribution that provides it"


PLUGIN_KINDS: dict[str, PluginKind] = {
    k.name: k
    for k in (
        PluginKind(
            name="scheduler_policy",
            hook="register_scheduler_policies",
            word="scheduler policy",
            factory=SchedulerPolicyFactory,
            product=interfaces.SchedulerPolicy,
            section="scheduler",
            selector="policy",
            builtin=("fcfs", "priority", "slo"),
            distributions={"sjf": "baton-contrib-sjf", "fair": "baton-contrib-fair"},
        ),
        PluginKind(
            name="executor",
            hook="register_executors",
            word="executor",
            factory=ExecutorFactory,
            product=interfaces.Executor,
            section="executor",
            selector="backend",
            builtin=("uniproc",),
            distributions={
                "cuda-tp": "baton-plugin-cuda-tp",
                "pipeline": "baton-plugin-pipeline",
                "ray": "baton-plugin-ray",
            },
        ),
        PluginKind(
            name="engine_launcher",
            hook="register_engine_launchers",
            word="engine launcher",
            factory=EngineLauncherFactory,
            product=interfaces.EngineLauncher,
            section="executor",
            selector="data_parallel_backend",
            builtin=("mp",),
            distributions={"ray": "baton-plugin-ray"},
        ),
        PluginKind(
            name="transport",
            hook="register_transports",
            word="transport",
            factory=TransportFactory,
            product=interfaces.Transport,
            section="transport",
            selector="name",
            builtin=("inproc",),
            distributions={"zmq": "baton-plugin-zmq", "shm": "baton-plugin-shm"},
        ),
        PluginKind(
            name="structured_output",
            hook="register_structured_output_backends",
            word="structured-output backend",
            factory=StructuredOutputFactory,
            product=interfaces.StructuredOutputBackend,
            section="structured_output",
            selector="backend",
            unselected=frozenset({"auto", "none"}),
            distributions={"xgrammar": "baton-plugin-xgrammar"},
        ),
        PluginKind(
            name="stat_logger",
            hook="register_stat_loggers",
            word="stat logger",
            factory=StatLoggerFactory,
            product=interfaces.StatLogger,
            section="observability",
            selector="stat_loggers",
            many=True,
            builtin=("logging",),
            distributions={"prometheus": "baton-plugin-openai"},
        ),
        PluginKind(
            name="speculator",
            hook="register_speculators",
            word="speculator",
            factory=SpeculatorFactory,
            product=interfaces.Speculator,
            section="speculative",
            selector="method",
            unselected=frozenset({"none"}),
            builtin=("ngram",),
            distributions={"suffix": "baton-plugin-suffix"},
        ),
        PluginKind(
            name="kv_connector",
            hook="register_kv_connectors",
            word="KV connector",
            factory=KVConnectorFactory,
            product=None,
            section="kv_transfer",
            selector="connector",
            unselected=frozenset({"none"}),
            builtin=("offload", "pd"),
        ),
        PluginKind(
            name="router",
            hook="register_routers",
            word="router",
            factory=RouterFactory,
            product=interfaces.Router,
            section="routing",
            selector="router",
            builtin=("least-loaded", "round-robin", "prefix-aware"),
        ),
        PluginKind(
            name="command",
            hook="register_commands",
            word="command",
            factory=CommandFactory,
            product=None,
            builtin=("generate", "chat", "plugins", "bench", "config", "env"),
            distributions={
                "serve": "baton-plugin-openai",
                "run-batch": "baton-plugin-openai",
                "pd-proxy": "baton-plugin-openai",
            },
        ),
        PluginKind(
            name="config_section",
            hook="register_config_sections",
            word="config section",
            factory=ConfigSectionModel,
            product=None,
            distributions={"server": "baton-plugin-openai"},
        ),
        PluginKind(
            name="bench",
            hook="register_benches",
            word="benchmark",
            factory=BenchFactory,
            product=None,
            distributions={
                name: "baton-bench"
                for name in (
                    "scheduler",
                    "simulate",
                    "transport",
                    "throughput",
                    "latency",
                    "serve",
                    "multiturn",
                )
            },
        ),
    )
}

#: hook name -> its kind
BY_HOOK: dict[str, PluginKind] = {k.hook: k for k in PLUGIN_KINDS.values()}
#: config section -> the kind whose plugins' settings sub-tables it holds: the first kind of
#: that section (``executor``'s sub-tables are executors'; an engine launcher shares the
#: sub-table of the executor of its name)
BY_SECTION: dict[str, PluginKind] = {}
for _k in PLUGIN_KINDS.values():
    if _k.section is not None:
        BY_SECTION.setdefault(_k.section, _k)

#: plugin kind -> (section, field) naming the plugin, for kinds selected by one name.
PLUGIN_SELECTORS: dict[str, tuple[str, str]] = {
    k.name: (k.section, k.selector)
    for k in PLUGIN_KINDS.values()
    if k.section is not None and k.selector is not None and not k.many
}


def kind_word(kind: str) -> str:
    """How messages name a plugin of ``kind`` (the kind itself when unknown)."""
    record = PLUGIN_KINDS.get(kind)
    return record.word if record else kind


def markdown_table() -> str:
    """The kind list of docs/hooks.md, rendered from ``PLUGIN_KINDS``."""

    def names(values: Any) -> str:
        return ", ".join(f"`{n}`" for n in values) or "none"

    rows = [
        "| kind | hook | selected by | settings sub-table | factory | built in | other distributions |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in PLUGIN_KINDS.values():
        selector = f"`{k.selector_path()}`" + (" (a list)" if k.many else "") if k.section else "-"
        table = f"`[{k.section}.<name>]`" if k.takes_settings else "-"
        others = ", ".join(f"`{n}` ({d})" for n, d in k.distributions.items()) or "none"
        rows.append(
            f"| `{k.name}` | `{k.hook}` | {selector} | {table} | `{k.factory.__name__}` "
            f"| {names(k.builtin)} | {others} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
