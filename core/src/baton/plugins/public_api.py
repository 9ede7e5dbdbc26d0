"""The names a plugin may import from baton: one list, grouped by who needs them, which
docs/stability.md prints.

``SURFACE`` maps each audience (a plugin kind as ``PLUGIN_KINDS`` names it, or every plugin,
or the testing kit) to the modules and names an author of it needs; ``PUBLIC_NAMES`` merges it
per module. ``ALL`` means every name of the module that does not start with an underscore.
Whatever is not listed is internal and may change in any release.
``tests/core/test_public_api.py`` fails when docs/stability.md's copy differs (``python -m
baton.plugins.public_api`` prints it), when a listed name does not exist, when a plugin kind
has no group, and when a plugin under plugins/ or contrib/ imports an unlisted name.
"""

from __future__ import annotations

import importlib
from typing import Final

#: Every name of the module not starting with an underscore.
ALL: Final = "*"

Names = tuple[str, ...] | str

_SUITES = (
    "SchedulerPolicyConformance",
    "ExecutorConformance",
    "TransportConformance",
    "StructuredOutputConformance",
    "SpeculatorConformance",
    "RouterConformance",
    "EngineLauncherConformance",
    "KVConnectorConformance",
)

#: The audiences that are not a plugin kind.
EVERY_PLUGIN: Final = "every plugin"
TESTS: Final = "tests"

SURFACE: dict[str, dict[str, Names]] = {
    # what every plugin module and factory meets: the hooks, the kinds, the config every
    # factory is given, the errors, the structs the engine's parts exchange
    EVERY_PLUGIN: {
        "baton": ("BatonConfig", "PLUGIN_API_VERSION", "__version__", "hookimpl"),
        "baton.plugins.hookspecs": (
            "PLUGIN_API_VERSION",
            "hookimpl",
            "register_scheduler_policies",
            "register_executors",
            "register_engine_launchers",
            "register_transports",
            "register_structured_output_backends",
            "register_stat_loggers",
            "register_speculators",
            "register_kv_connectors",
            "register_routers",
            "register_commands",
            "register_config_sections",
            "register_benches",
        ),
        "baton.plugins.kinds": (
            "PLUGIN_KINDS",
            "PluginKind",
            "Register",
            "SchedulerPolicyFactory",
            "ExecutorFactory",
            "EngineLauncherFactory",
            "TransportFactory",
            "StructuredOutputFactory",
            "StatLoggerFactory",
            "SpeculatorFactory",
            "KVConnectorFactory",
            "RouterFactory",
            "CommandFactory",
            "ConfigSectionModel",
            "BenchFactory",
        ),
        "baton.errors": ALL,
        "baton.protocol": ALL,
        "baton.config": (
            "BatonConfig",
            "ModelSection",
            "CacheSection",
            "SchedulerSection",
            "ExecutorSection",
            "TransportSection",
            "StructuredOutputSection",
            "SpeculativeSection",
            "KVTransferSection",
            "RoutingSection",
            "LoRASection",
            "KVEventsSection",
            "ObservabilitySection",
        ),
    },
    # a policy decides from what it reads of the requests; the mechanism acts
    "scheduler_policy": {
        "baton.interfaces": ("SchedulerPolicy", "FinishAwarePolicy", "VictimAwarePolicy"),
        "baton.request": ("Request", "RequestStatus"),
        "baton.scheduling_info": ("SchedulingInfo",),
        "baton.sched.slo": ("has_slo", "ttft_deadline", "is_hopeless", "met_slo"),
        "baton.sched.victims": ("VictimCandidate",),
    },
    # an executor: the protocols, and the toolkit to build one from baton's worker processes,
    # call book and ranks (baton-plugin-cuda-tp, -pipeline and -ray are built from it)
    "executor": {
        "baton.interfaces": ("Executor", "ModelRunner", "RunnerFactory", "Worker", "Sleepable"),
        "baton.runner": (
            "StockRunner",
            "ModelRunnerHooks",
            "LoadedModel",
            "KVShape",
            "model_config",
            "load_worker",
        ),
        "baton.rpc": ("register_worker_rpc", "worker_rpc_names", "WORKER_RPC_METHODS"),
        "baton.executor.multiproc": ("MultiprocExecutor",),
        "baton.executor.group_executor": ("GroupExecutor",),
        "baton.executor.workers": ("MultiprocSettings", "pick_device", "pick_transport"),
        "baton.executor.group": ("WorkerGroup",),
        "baton.executor.calls": ("CallBook", "Call"),
        "baton.executor.member": ("MemberLink", "Member", "Message", "READY", "SHUTDOWN"),
        "baton.executor.latch": ("FailureLatch",),
        "baton.executor.heartbeat": ("Heartbeats",),
        # an executor that places its ranks itself (the ray executor's actors)
        "baton.executor.rank": (
            "Rank",
            "RankBootstrap",
            "RankMember",
            "rank_bootstraps",
            "rank_config",
            "host_store",
            "StepCodec",
            "parallel_stats",
            "reset_parallel_stats",
        ),
        "baton.executor.wire": ("Kind", "WorkerReady"),
        "baton.parallel": ("ParallelContext", "CommTimers", "get_parallel_context"),
        "baton.parallel.sharding": ALL,
        "baton.parallel.stages": ALL,
        "baton.parallel.hooks": (
            "TensorParallelHooks",
            "PipelineStageHooks",
            "parallel_runner",
            "check_parallel_model",
        ),
    },
    # an engine launcher: the local-process one, and what runs where it places an engine
    "engine_launcher": {
        "baton.interfaces": ("EngineLauncher", "EngineHandle"),
        "baton.engine.launch": ("ProcessLauncher", "ProcessHandle", "run_engine_core"),
    },
    "transport": {
        "baton.interfaces": ("Transport", "ClientChannel", "EngineChannel", "Frame"),
        "baton.transport.peer": ("PeerWatch", "POLL_SLICE", "machine_id"),
        "baton.transport.sweep": ("sweep_stale",),
        "baton.transport.closing": ("release_when_idle",),
    },
    "structured_output": {
        "baton.interfaces": ("StructuredOutputBackend", "GrammarMatcher"),
        "baton.sampling_params": ("StructuredOutputSpec",),
    },
    "stat_logger": {
        "baton.interfaces": ("StatLogger",),
        "baton.metrics.stats": ("IterationStats",),
    },
    # a speculator proposes from the running requests' tokens
    "speculator": {
        "baton.interfaces": ("Speculator",),
        "baton.request": ("Request",),
    },
    # a KV connector: its two halves' protocols and structs, the request its scheduler half
    # reads, and KV events for its tiers (baton.kv_transfer.connector's docstring is the design)
    "kv_connector": {
        "baton.kv_transfer.connector": ALL,
        "baton.kv_transfer.types": ALL,
        "baton.kv.events": ALL,
        "baton.request": ("Request",),
        # the offload connector's disk tier, reusable by other connectors (a /dev/shm store)
        "baton.kv_transfer.offload.disk_tier": ("BlockFileStore", "BlockFileHeader"),
    },
    "router": {
        "baton.interfaces": ("Router",),
        "baton.routing": ("EngineLoad", "RouteRequest"),
    },
    # commands, servers among them (baton-plugin-openai): the engine they run (AsyncLLM, LLM),
    # its requests' parameters and outputs, the engine flags, and what a server shows of itself
    # (the installed plugins, the CPU and each kernel's path, as `baton plugins` / `baton env`)
    "command": {
        "baton": (
            "LLM",
            "AsyncLLM",
            "BeamSearchOutput",
            "BeamSearchParams",
            "BeamSearchSequence",
            "CompletionOutput",
            "Logprob",
            "PoolingOutput",
            "PoolingParams",
            "PoolingRequestOutput",
            "LoRARequest",
            "RequestOutput",
            "RequestOutputKind",
            "SamplingParams",
            "SchedulingInfo",
            "StructuredOutputSpec",
        ),
        "baton.sampling_params": (
            "SamplingParams",
            "StructuredOutputSpec",
            "RequestOutputKind",
            "MAX_INT32",
            "MAX_LOGPROBS",
            "MAX_N",
            "MAX_SEED",
            "show_value",
        ),
        "baton.pooling_params": (
            "PoolingParams",
            "POOLING_TYPES",
            "check_pooling",
            "with_defaults",
        ),
        "baton.scheduling_info": (
            "SchedulingInfo",
            "as_scheduling_info",
            "MAX_TAGS",
            "MAX_TAG_KEY_CHARS",
            "MAX_TAG_VALUE_CHARS",
            "MAX_TENANT_CHARS",
            "MAX_DEADLINE_S",
            "MAX_SLO_MS",
        ),
        "baton.validation": (
            "check_request",
            "checked_request",
            "CheckedRequest",
            "PRIORITY_MIN",
            "PRIORITY_MAX",
        ),
        "baton.outputs": (
            "RequestOutput",
            "CompletionOutput",
            "Logprob",
            "SampleLogprobs",
            "PromptLogprobs",
            "PoolingOutput",
            "PoolingRequestOutput",
        ),
        "baton.beam_search": (
            "BeamSearchParams",
            "BeamSearchOutput",
            "BeamSearchSequence",
            "BeamSearch",
            "beam_search_score",
        ),
        # LoRA adapters: the request's adapter, PEFT folders read without peft
        "baton.lora": ("LoRARequest", "as_lora_request", "check_lora_request"),
        "baton.lora.adapter": (
            "AdapterConfig",
            "AdapterWeights",
            "TARGET_MODULES",
            "load_adapter",
            "read_adapter_config",
        ),
        "baton.metrics.stats": ("IterationStats",),
        "baton.cli.main": ("add_engine_arguments", "engine_overrides", "engine_argv"),
        "baton.plugins": ("get_registry", "Registry", "PluginEntry"),
        "baton.kernels.report": ("collect", "render", "CpuReport", "KernelPath"),
        "baton.kernels.os_grant": ("Grant",),
    },
    # a config section (baton-plugin-openai's [server]): a pydantic model, and what the kernel
    # reads of the serving plugin's section (its serving_settings())
    "config_section": {
        "baton.config": ("ServingSettings",),
    },
    # a benchmark measures an engine through the commands' surface (the bench toolkit itself is
    # baton_bench.common, in baton-bench) and drives a scheduler with the testing kit's driver
    "bench": {
        "baton": ("LLM", "SamplingParams"),
        "baton.cli.main": ("add_engine_arguments", "engine_overrides", "engine_argv"),
        "baton.kernels.report": ("collect", "CpuReport"),
        "baton.testing.sched_harness": ALL,
    },
    # the testing kit: a fake executor, tiny models, a scheduler driver, each kind's suite
    TESTS: {
        "baton.testing": ("FakeExecutor", "FakeExecutorSettings", "register_fake_executor"),
        "baton.testing.tiny_model": ("tiny_model", "make_tiny_model", "MOE_ARCHS"),
        "baton.testing.sched_harness": ALL,
        "baton.testing.conformance": _SUITES,
        "baton.testing.conformance.scheduler_policy": ("SchedulerPolicyConformance",),
        "baton.testing.conformance.executor": ("ExecutorConformance",),
        "baton.testing.conformance.transport": ("TransportConformance",),
        "baton.testing.conformance.structured_output": ("StructuredOutputConformance",),
        "baton.testing.conformance.speculator": ("SpeculatorConformance", "PROMPTS", "run_engine"),
        "baton.testing.conformance.router": ("RouterConformance",),
        "baton.testing.conformance.engine_launcher": ("EngineLauncherConformance", "PROMPTS"),
        "baton.testing.conformance.kv_connector": (
            "KVConnectorConformance",
            "PROMPTS",
            "run_requests",
            "Finished",
        ),
        "baton.testing.kv_connector": (
            "register_memory_connector",
            "unregister_memory_connector",
            "MemoryConnector",
            "MemorySettings",
        ),
    },
}


def _merged(surface: dict[str, dict[str, Names]]) -> dict[str, Names]:
    """Each module's public names over every audience (in first-listed order, once each)."""
    out: dict[str, Names] = {}
    for modules in surface.values():
        for module, names in modules.items():
            before = out.get(module, ())
            if ALL in (before, names):
                out[module] = ALL
            else:
                out[module] = tuple(dict.fromkeys((*before, *names)))
    return out


#: Module -> its public names (``ALL``: every name without a leading underscore).
PUBLIC_NAMES: dict[str, Names] = _merged(SURFACE)


def is_public(module: str, name: str | None = None) -> bool:
    """Whether ``from module import name`` (``import module`` when ``name`` is None) is public."""
    names = PUBLIC_NAMES.get(module)
    if names is None:
        return False
    if name is None:
        return names == ALL  # importing a whole module reaches all of its names
    if names == ALL:
        return not name.startswith("_")
    return name in names


def missing_names() -> list[str]:
    """``module.name`` of every listed name that does not exist (the list went stale)."""
    missing = []
    for module, names in PUBLIC_NAMES.items():
        mod = importlib.import_module(module)
        if names != ALL:
            missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    return missing


def markdown() -> str:
    """The list as docs/stability.md shows it: one row per audience and module."""
    rows = ["| for | module | public names |", "|---|---|---|"]
    for audience, modules in SURFACE.items():
        for module, names in modules.items():
            shown = (
                "every name without a leading underscore"
                if names == ALL
                else ", ".join(f"`{n}`" for n in names)
            )
            rows.append(f"| {audience} | `{module}` | {shown} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
