"""The names a plugin may import from baton: one list, which docs/stability.md prints.

``PUBLIC_NAMES`` maps a module to its public names; ``ALL`` means every name of
the module that does not start with an underscore. Whatever is not listed is
internal and may change in any release. ``tests/core/test_public_api.py`` fails
when docs/stability.md's copy differs (``python -m baton.plugins.public_api`` prints it),
when a listed name does not exist, and when a plugin under plugins/ or contrib/
imports an unlisted name.
"""

from __future__ import annotations

import importlib
from typing import Final

#: Every name of the module not starting with an underscore.
ALL: Final = "*"

_SUITES = (
    "SchedulerPolicyConformance",
    "ExecutorConformance",
    "TransportConformance",
    "StructuredOutputConformance",
    "SpeculatorConformance",
    "RouterConformance",
    "EngineLauncherConformance",
)

PUBLIC_NAMES: dict[str, tuple[str, ...] | str] = {
    # the offline API and plugin basics
    "baton": (
        "LLM",
        "AsyncLLM",
        "BatonConfig",
        "BeamSearchOutput",
        "BeamSearchParams",
        "BeamSearchSequence",
        "CompletionOutput",
        "Logprob",
        "PLUGIN_API_VERSION",
        "PoolingOutput",
        "PoolingParams",
        "PoolingRequestOutput",
        "LoRARequest",
        "RequestOutput",
        "RequestOutputKind",
        "SamplingParams",
        "SchedulingInfo",
        "StructuredOutputSpec",
        "__version__",
        "hookimpl",
    ),
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
        "register_routers",
        "register_commands",
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
        "RouterFactory",
        "CommandFactory",
        "BenchFactory",
    ),
    "baton.interfaces": (
        "SchedulerPolicy",
        "FinishAwarePolicy",
        "VictimAwarePolicy",
        "Executor",
        "ModelRunner",
        "RunnerFactory",
        "Worker",
        "Sleepable",
        "EngineLauncher",
        "EngineHandle",
        "Transport",
        "ClientChannel",
        "EngineChannel",
        "Frame",
        "StructuredOutputBackend",
        "GrammarMatcher",
        "StatLogger",
        "Speculator",
        "Router",
    ),
    "baton.protocol": ALL,
    "baton.errors": ALL,
    "baton.config": (
        "BatonConfig",
        "ModelSection",
        "CacheSection",
        "SchedulerSection",
        "ExecutorSection",
        "TransportSection",
        "StructuredOutputSection",
        "SpeculativeSection",
        "RoutingSection",
        "LoRASection",
        "ObservabilitySection",
        "ServingSettings",
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
    "baton.pooling_params": ("PoolingParams", "POOLING_TYPES", "check_pooling", "with_defaults"),
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
    "baton.request": ("Request", "RequestStatus"),
    # what a policy reads about SLOs and preemption victims
    "baton.sched.slo": ("has_slo", "ttft_deadline", "is_hopeless", "met_slo"),
    "baton.sched.victims": ("VictimCandidate",),
    # LoRA adapters: the request's adapter, PEFT folders read without peft
    "baton.lora": ("LoRARequest", "as_lora_request", "check_lora_request"),
    "baton.lora.request": ("LoRARequest", "as_lora_request", "check_lora_request"),
    "baton.lora.adapter": (
        "AdapterConfig",
        "AdapterWeights",
        "TARGET_MODULES",
        "load_adapter",
        "read_adapter_config",
    ),
    "baton.beam_search": (
        "BeamSearchParams",
        "BeamSearchOutput",
        "BeamSearchSequence",
        "BeamSearch",
        "beam_search_score",
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
    "baton.validation": (
        "check_request",
        "checked_request",
        "CheckedRequest",
        "PRIORITY_MIN",
        "PRIORITY_MAX",
    ),
    "baton.metrics.stats": ("IterationStats",),
    # for server and command plugins
    "baton.frontend.input_processor": ("InputProcessor",),
    "baton.cli.main": ("add_engine_arguments", "engine_overrides", "ENGINE_FLAGS"),
    # the installed plugins (what `baton plugins` lists), the CPU and each kernel's path (what
    # `baton env` prints): what a server shows of itself (baton-plugin-openai's dashboard)
    "baton.plugins": ("get_registry", "Registry", "PluginEntry"),
    "baton.kernels.report": ("collect", "render", "CpuReport", "KernelPath"),
    "baton.kernels.os_grant": ("Grant",),
    # for router plugins
    "baton.routing": ("EngineLoad", "RouteRequest"),
    # collective_rpc's targets: the Worker allow-list and registered names
    "baton.rpc": ("register_worker_rpc", "worker_rpc_names", "WORKER_RPC_METHODS"),
    # the transport plugins' toolkit
    "baton.transport.peer": ("PeerWatch", "POLL_SLICE", "machine_id"),
    # engine launchers: the local-process one, and what a launcher runs where it places an engine
    "baton.engine.launch": ("ProcessLauncher", "ProcessHandle", "run_engine_core"),
    "baton.transport.sweep": ("sweep_stale",),
    "baton.transport.closing": ("release_when_idle",),
    # the executor plugins' toolkit
    "baton.runner": (
        "StockRunner",
        "ModelRunnerHooks",
        "LoadedModel",
        "KVShape",
        "model_config",
        "load_worker",
    ),
    "baton.executor.group": ("WorkerGroup",),
    "baton.executor.calls": ("CallBook", "Call"),
    "baton.executor.member": ("MemberLink", "Member", "Message", "READY", "SHUTDOWN"),
    "baton.executor.multiproc": ("MultiprocExecutor",),
    "baton.executor.workers": ("MultiprocSettings", "pick_device", "pick_transport"),
    "baton.executor.latch": ("FailureLatch",),
    "baton.executor.heartbeat": ("Heartbeats",),
    "baton.executor.rank": (
        "Rank",
        "RankBootstrap",
        "RankMember",
        "rank_bootstraps",
        "rank_config",
        "host_store",
        "check_plugin_set",
        "check_rpc_method",
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
    # the testing kit
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
}


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
    """The list as docs/stability.md shows it."""
    rows = ["| module | public names |", "|---|---|"]
    for module, names in PUBLIC_NAMES.items():
        shown = (
            "every name without a leading underscore"
            if names == ALL
            else ", ".join(f"`{n}`" for n in names)
        )
        rows.append(f"| `{module}` | {shown} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
