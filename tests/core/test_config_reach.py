"""Config resolved once (issue 31): the whole ``BatonConfig`` reaches only the modules that build
it, resolve it, hand it to a plugin factory (``factory(config, settings)``, docs/hooks.md) or ship
it to an executor's workers; every other component is built with its own sections. A module that
starts naming ``BatonConfig`` fails here until it is given its sections instead, or is listed
with its reason."""

from __future__ import annotations

import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core" / "src" / "baton"
NAMES = re.compile(r"\bBatonConfig\b")

#: module (relative to baton/) -> why it takes the whole config
REACHED: dict[str, str] = {
    "__init__.py": "re-exports it (public)",
    "config/__init__.py": "the config package",
    "config/baton_config.py": "defines it",
    "config/overrides.py": "the keyword forms BatonConfig.load / replace take",
    "config/sections.py": "its sections' docstrings name it",
    "config_sections.py": "the plugin-registered sections BatonConfig validates",
    "cli/main.py": "the CLI builds the config from flags",
    "cli/config_check.py": "`baton config` checks and prints a config",
    "frontend/llm.py": "LLM builds the config and resolves it (the frontend's resolve step)",
    "frontend/async_llm.py": "AsyncLLM: as LLM",
    "engine/client.py": "the in-process client builds an EngineCore from it",
    "engine/clients.py": "picks the client kind for a config",
    "engine/core.py": "EngineCore resolves it once and hands each component its sections",
    "engine/core_main.py": "the engine process receives it (then as EngineCore)",
    "engine/dp_client.py": "gives each data-parallel engine its config",
    "engine/mp_client.py": "ships it to the engine process",
    "engine/launch.py": "engine_launcher factory (plugin contract) and the process it starts",
    "executor/multiproc.py": "executor factory; ships the config to its workers",
    "executor/uniproc.py": "executor factory; builds its Worker from the config",
    "executor/rank.py": "each rank's config (public toolkit: rank_config, RankBootstrap)",
    "executor/workers.py": "public toolkit pick_device / pick_transport (a transport factory)",
    "worker/worker.py": "receives the config across the process boundary; runner_settings",
    "runner.py": "public executor toolkit: StockRunner / load_worker / model_config",
    "parallel/expert.py": "expert_parallel_runner is a RunnerFactory (config, device)",
    "parallel/hooks.py": "public check_parallel_model(config, tp, pp)",
    "interfaces.py": "the plugin protocols' factory signatures",
    "metrics/logging_logger.py": "a stat_logger factory (plugin contract)",
    "routing/prefix_aware.py": "a router factory (plugin contract)",
    "plugins/check.py": "the start-up check of a config's plugins",
    "plugins/resolve.py": "resolves a config's plugins once",
    "plugins/registry.py": "PluginEntry.settings / ChosenPlugin.create(config, ...)",
    "plugins/kinds.py": "the factory protocols (factory(config, settings))",
    "plugins/hookspecs.py": "the hook specs' docs of the factories",
    "plugins/public_api.py": "lists it as public",
    "testing/sched_harness.py": "public PolicyHarness(policy, config)",
    "testing/conformance/engine_launcher.py": "public suite: builds configs for the plugin",
    "testing/conformance/executor.py": "public suite: as above",
    "testing/conformance/kv_connector.py": "public suite: as above",
    "testing/conformance/router.py": "public suite: as above",
    "testing/conformance/scheduler_policy.py": "public suite: as above",
    "testing/conformance/speculator.py": "public suite: as above",
    "testing/conformance/structured_output.py": "public suite: as above",
    "testing/conformance/transport.py": "public suite: as above",
}


def modules_naming_the_config() -> set[str]:
    return {
        str(p.relative_to(CORE))
        for p in CORE.rglob("*.py")
        if NAMES.search(p.read_text(encoding="utf-8"))
    }


def test_only_the_listed_modules_take_the_whole_config():
    extra = sorted(modules_naming_the_config() - set(REACHED))
    assert not extra, (
        f"{extra} name BatonConfig: build the component with its own sections (as Scheduler, "
        "ModelRunner's RunnerSettings, StructuredOutputManager), or list the module in REACHED "
        "with why it needs the whole config"
    )


def test_the_list_has_no_stale_entry():
    stale = sorted(set(REACHED) - modules_naming_the_config())
    assert not stale, f"{stale} no longer name BatonConfig: drop them from REACHED"


def test_below_the_worker_only_sections_arrive():
    below = ("model/", "worker/model_runner.py", "worker/kv_cache.py", "structured/", "sched/")
    named = sorted(m for m in modules_naming_the_config() if m.startswith(below))
    assert named == [], named
