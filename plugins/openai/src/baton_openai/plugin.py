"""Plugin module of baton-plugin-openai: registers commands ``serve``, ``run-batch`` and ``pd-proxy``, stat
logger ``prometheus`` and the ``[server]`` config section (``baton bench serve``, its HTTP load, is baton-bench's).

Plugins load in every process baton spawns (engine cores too), so this module
imports nothing heavy: FastAPI, uvicorn and prometheus-client load only when
the command runs or the stat logger is built.
"""

from __future__ import annotations

from typing import Any

from baton import hookimpl

BATON_PLUGIN_API = 1


def serve_command(parser: Any) -> Any:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    from baton_openai.cli import add_serve_arguments, run_serve

    add_serve_arguments(parser)
    return run_serve


def run_batch_command(parser: Any) -> Any:
    """Run a batch file offline (vLLM's run_batch): -i IN.jsonl -o OUT.jsonl, one result per line."""
    from baton_openai.batch.run_batch import add_arguments, main

    add_arguments(parser)
    return main


def create_prometheus_logger(config: Any, settings: Any = None, engine_index: int = 0) -> Any:
    """The registered factory: ``factory(config, settings, engine_index)``."""
    from baton_openai.metrics.prometheus import PrometheusStatLogger

    return PrometheusStatLogger(config, settings, engine_index)


def pd_proxy_command(parser: Any) -> Any:
    """Disaggregated serving: prefill each request on a producer engine, decode on a consumer."""
    from baton_openai.pd_proxy.cli import add_arguments, main

    add_arguments(parser)
    return main


@hookimpl
def register_commands(register: Any) -> None:
    register("serve", serve_command)
    register("run-batch", run_batch_command)
    register("pd-proxy", pd_proxy_command)


@hookimpl
def register_stat_loggers(register: Any) -> None:
    from baton_openai.metrics.settings import PrometheusSettings

    register("prometheus", create_prometheus_logger, PrometheusSettings)


@hookimpl
def register_config_sections(register: Any) -> None:
    # pydantic only: the section is validated in every process that builds a config
    from baton_openai.server_section import ServerSection

    register("server", ServerSection)
