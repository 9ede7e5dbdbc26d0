"""The plugin contract of baton: one hookspec per extension point.

Every hook is a *registration* hook in the style of simonw/llm: it receives a
``register(name, factory, settings_model=None)`` callback and returns nothing.
The kernel owns the registry, so it can refuse duplicate names, say which
distribution provided what, and validate a plugin's settings sub-table with the
``settings_model`` (a pydantic model) before calling the factory.

Hooks run once per process, when the registry is first needed (engine start,
``baton plugins``, CLI start-up), in every process the kernel spawns (engine
core, workers). A hook must only register: no I/O, no threads, no heavy
imports (import heavy dependencies inside the factory).

Installing a plugin only makes its names available; the config chooses.
The factory signatures below are part of the contract, typed as the protocols
in ``baton.plugins.kinds`` (``Register[SchedulerPolicyFactory]``, ...), which
also holds what the kernel knows about each kind (``PLUGIN_KINDS``); the
protocols their products implement are in ``baton.interfaces``.

Nothing here is imported at runtime but pluggy (types are under TYPE_CHECKING),
so this module never causes an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from baton.plugins.kinds import (
        BenchFactory,
        CommandFactory,
        ConfigSectionModel,
        EngineLauncherFactory,
        ExecutorFactory,
        KVConnectorFactory,
        Register,
        RouterFactory,
        SchedulerPolicyFactory,
        SpeculatorFactory,
        StatLoggerFactory,
        StructuredOutputFactory,
        TransportFactory,
    )

#: The version of this contract. A plugin module may declare
#: ``BATON_PLUGIN_API = 1`` (or a list of versions it supports); a plugin that
#: declares versions not including this one is refused at load.
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker("baton")
hookimpl = pluggy.HookimplMarker("baton")


# ---------------------------------------------------------------------------
# scheduling
# ---------------------------------------------------------------------------


@hookspec
def register_scheduler_policies(register: Register[SchedulerPolicyFactory]) -> None:
    """Register scheduler policies: which waiting request runs next, who is preempted.

    :param register: call ``register(name, factory, settings_model=None)`` once per
        policy. ``factory(config, settings)`` receives the BatonConfig and the
        validated ``[scheduler.<name>]`` settings (or None) and returns an object
        implementing ``baton.interfaces.SchedulerPolicy``.

    Selected by ``scheduler.policy``. Called once per process when the registry
    loads; the factory is called once per engine core, in the engine process.
    Built in: ``fcfs``, ``priority`` (``baton.sched.policies``).
    """


# ---------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------


@hookspec
def register_executors(register: Register[ExecutorFactory]) -> None:
    """Register executor backends: how the model runs (in-process, TP, PP, ...).

    :param register: ``register(name, factory, settings_model=None)``;
        ``factory(config, settings)`` returns an object implementing
        ``baton.interfaces.Executor``. It may start worker processes; it must
        not allocate the KV cache (the core sizes it and calls
        ``initialize_kv_cache``).

    Selected by ``executor.backend``. The factory is called once, in the engine
    process, before the KV cache is sized. Built in: ``uniproc``.
    """


@hookspec
def register_engine_launchers(register: Register[EngineLauncherFactory]) -> None:
    """Register engine launchers: where a frontend's engine cores run (local processes, Ray
    actors, ...).

    :param register: ``register(name, factory, settings_model=None)``; ``factory(config,
        settings)`` returns a ``baton.interfaces.EngineLauncher``, whose ``launch(config,
        address, engine_index, fingerprint)`` starts ``baton.engine.launch.run_engine_core``
        with those arguments wherever it places the engine and returns a
        ``baton.interfaces.EngineHandle`` (alive?, terminate, kill, join, describe).
        ``settings`` is the validated ``[executor.<name>]`` sub-table (shared with the
        executor of the same name, if any; None without a settings model).

    Selected by ``executor.data_parallel_backend``. The factory is called once per frontend
    client whose transport crosses processes (zmq, shm), in the frontend's process, before
    any engine starts; ``launch`` once per engine (``data_parallel_size`` of them), ``close``
    after shutdown. Built in: ``mp`` (``baton.engine.launch``: a local process each).
    """


# ---------------------------------------------------------------------------
# transport
# ---------------------------------------------------------------------------


@hookspec
def register_transports(register: Register[TransportFactory]) -> None:
    """Register frontend <-> engine-core transports.

    :param register: ``register(name, factory, settings_model=None)``;
        ``factory(config, settings)`` returns an object implementing
        ``baton.interfaces.Transport``, which makes the client-side channel (in
        the frontend) and, from a picklable address, the engine-side channel
        (in the engine process).

    Selected by ``transport.name``. Called in the frontend and, for the engine
    side, in the engine process. Built in: ``inproc``.
    """


# ---------------------------------------------------------------------------
# structured output
# ---------------------------------------------------------------------------


@hookspec
def register_structured_output_backends(register: Register[StructuredOutputFactory]) -> None:
    """Register structured-output (grammar) backends.

    :param register: ``register(name, factory, settings_model=None)``;
        ``factory(config, settings, tokenizer, vocab_size)`` returns an object
        implementing ``baton.interfaces.StructuredOutputBackend``. ``vocab_size``
        is the model's (the logits' width), which may exceed the tokenizer's.

    Selected by ``structured_output.backend``. The factory is called in the
    engine process the first time a request carries a structured-output spec.
    Built in: none (``baton-plugin-xgrammar`` provides ``xgrammar``).
    """


# ---------------------------------------------------------------------------
# speculative decoding
# ---------------------------------------------------------------------------


@hookspec
def register_speculators(register: Register[SpeculatorFactory]) -> None:
    """Register speculators: proposers of draft tokens that the model verifies in one step.

    :param register: ``register(name, factory, settings_model=None)``;
        ``factory(config, settings)`` receives the BatonConfig and the validated
        ``[speculative.<name>]`` settings (or None) and returns an object
        implementing ``baton.interfaces.Speculator``.

    Selected by ``speculative.method`` (``none``, the default: no speculation).
    The factory is called once per engine core, in the engine process.
    Built in: ``ngram`` (prompt lookup, ``baton.speculative.ngram``).
    """


# ---------------------------------------------------------------------------
# KV blocks outside the engine's pool
# ---------------------------------------------------------------------------


@hookspec
def register_kv_connectors(register: Register[KVConnectorFactory]) -> None:
    """Register KV connectors: tiers (RAM, disk) or other engines that keep KV blocks outside
    the engine's own pool, loaded into a request's blocks and saved from them.

    :param register: ``register(name, factory, settings_model=None)``;
        ``factory(config, settings)`` receives the BatonConfig and the validated
        ``[kv_transfer.<name>]`` settings (or None) and returns a
        ``baton.kv_transfer.connector.KVConnector``: the maker of its scheduler half and its
        worker half.

    Selected by ``kv_transfer.connector`` (``none``, the default: the pool only), with
    ``kv_transfer.role``. The factory is called once in the engine process (the scheduler
    half, ``scheduler_side``) and once in each worker process (``worker_side``);
    docs/kv-connectors.md says when each half's calls run. Built in: ``offload`` (a RAM tier
    and a disk tier, docs/kv-offload.md), ``pd`` (prefill on a producer engine, decode on a
    consumer: docs/kv-connectors.md).
    """


# ---------------------------------------------------------------------------
# observability and command line
# ---------------------------------------------------------------------------


@hookspec
def register_stat_loggers(register: Register[StatLoggerFactory]) -> None:
    """Register stat loggers: observers of per-step engine and per-request stats.

    :param register: ``register(name, factory, settings_model=None)``;
        ``factory(config, settings, engine_index)`` returns an object
        implementing ``baton.interfaces.StatLogger``.

    Selected by ``observability.stat_loggers`` (a list). Factories are called in
    the frontend process when an LLM / AsyncLLM starts. Built in: ``logging``.
    """


@hookspec
def register_routers(register: Register[RouterFactory]) -> None:
    """Register data-parallel routers: which engine core serves each request.

    :param register: ``register(name, factory, settings_model=None)``; ``factory(config,
        settings)`` returns a ``baton.interfaces.Router``. ``settings`` is the validated
        ``[routing.<name>]`` sub-table (None without a settings model).

    Called when the plugins load; the factory runs once per frontend client that
    starts more than one engine core (``executor.data_parallel_size > 1``), in the
    frontend's process, for the router ``routing.router`` names. Built in:
    ``least-loaded`` (the default), ``round-robin``, ``prefix-aware``.
    """


@hookspec
def register_commands(register: Register[CommandFactory]) -> None:
    """Register ``baton`` CLI subcommands.

    :param register: ``register(name, factory)``; ``factory(parser)`` receives the
        subcommand's ``argparse.ArgumentParser``, adds its arguments and returns
        the handler ``handler(args: argparse.Namespace) -> int | None``. Every
        command gets ``--config`` added by the kernel.

    Called once when the CLI starts. Built in: ``generate``, ``chat``,
    ``plugins``, ``bench``, ``config``; ``baton-plugin-openai`` adds ``serve``.
    """


@hookspec
def register_config_sections(register: Register[ConfigSectionModel]) -> None:
    """Register top-level config sections: a plugin's own ``[<name>]`` table.

    :param register: ``register(name, model)``; ``model`` is a pydantic ``BaseModel``
        subclass, the table's settings (``baton-plugin-openai`` registers ``server``).

    Whenever a ``BatonConfig`` is built the table is validated with ``model`` (the file,
    ``BATON_<NAME>__<FIELD>`` variables decoded as any section's, ``LLM(**{"<name>.<field>":
    ...})``, and a field name no other section has as a short override: ``LLM(port=...)``);
    ``config.<name>`` is the instance. Optional methods of the model:
    ``check_config(self, config)`` (a check across sections: raise ``ValueError`` naming the
    fix) and ``serving_settings(self)`` (a ``baton.config.ServingSettings``: the values the
    kernel takes from the section of the plugin that serves). A name of baton-core's
    sections, or one registered twice, is refused. None built in.
    """


@hookspec
def register_benches(register: Register[BenchFactory]) -> None:
    """Register ``baton bench`` subcommands (benchmarks).

    :param register: ``register(name, factory)``; ``factory(parser)`` receives the
        benchmark's ``argparse.ArgumentParser`` (``baton bench <name>``), adds its
        arguments and returns the handler ``handler(args: argparse.Namespace) -> int |
        None``. The kernel adds no arguments: a benchmark that runs an engine adds
        ``baton.cli.main.add_engine_arguments`` itself.

    Called once when ``baton bench`` builds its parser. None built in: ``baton-bench``
    adds ``scheduler``, ``simulate``, ``transport``, ``throughput``, ``latency``, ``serve``
    (HTTP load against ``baton serve`` or any OpenAI-compatible server) and ``multiturn``
    (multi-turn chat sessions, the prefix cache and KV tiers).
    """
