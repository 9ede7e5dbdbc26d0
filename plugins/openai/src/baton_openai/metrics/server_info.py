"""What the dashboard shows about the server beside the engine's figures: the model, the loaded
plugins (with their distributions and settings), the CPU path of the kernels, the versions."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from baton import __version__
from baton.config import BatonConfig
from baton.kernels.report import CpuReport, collect
from baton.plugins import get_registry
from baton.plugins.kinds import PLUGIN_KINDS
from baton.protocol import ModelInfo
from baton_openai import __version__ as plugin_version


class PluginRow(msgspec.Struct, kw_only=True):
    """One registered plugin name, as ``baton plugins --json`` lists it."""

    kind: str
    name: str
    distribution: str
    version: str
    plugin: str
    selected: bool
    """The config selects it (``PluginKind.selected``)."""
    settings: dict[str, Any] | None
    """Its validated ``[<section>.<name>]`` table (None: it takes no settings)."""


class FailedPlugin(msgspec.Struct, kw_only=True):
    plugin: str
    distribution: str
    error: str


class ServerInfo(msgspec.Struct, kw_only=True):
    """What ``GET /ui/info`` answers (what the pages need that does not change while serving)."""

    model: str
    architecture: str
    max_model_len: int
    dtype: str
    """What the model computes in ("" until a worker has loaded it)."""
    dtype_native: bool
    """The device computes ``dtype`` in hardware (not emulated through float32)."""
    version: str
    plugin_version: str
    device: str
    data_parallel_size: int
    structured_output: bool
    """A structured-output backend is installed and not turned off: JSON-schema answers work."""
    tool_call_parser: str
    playground: bool
    cpu: CpuReport
    """``baton env``'s report: the CPU, the OS's AMX grant, each kernel's path and why."""
    plugins: list[PluginRow]
    failed_plugins: list[FailedPlugin]


def plugin_rows(config: BatonConfig) -> list[PluginRow]:
    """Every registered plugin name, whether the config selects it, and its settings."""
    rows = []
    for e in sorted(get_registry().entries.values(), key=lambda e: (e.kind, e.name)):
        kind = PLUGIN_KINDS[e.kind]
        settings = e.settings(config)
        rows.append(
            PluginRow(
                kind=e.kind,
                name=e.name,
                distribution=e.distribution,
                version=e.version,
                plugin=e.plugin,
                selected=e.name in kind.selected(config),
                settings=settings.model_dump(mode="json") if settings is not None else None,
            )
        )
    return rows


@functools.cache
def cpu_report() -> CpuReport:
    """``baton env``'s report, once per process; the kernels are loaded if this machine built
    them (the engine has by the time a page asks), never compiled here."""
    return collect(build_kernels=False)


def server_info(config: BatonConfig, model_name: str, model: ModelInfo) -> ServerInfo:
    """What the pages show of a server serving ``model`` as ``model_name``."""
    registry = get_registry()
    return ServerInfo(
        model=model_name,
        architecture=model.architecture,
        max_model_len=model.max_model_len,
        dtype=model.dtype,
        dtype_native=model.dtype_native,
        version=__version__,
        plugin_version=plugin_version,
        device=config.executor.device,
        data_parallel_size=config.executor.data_parallel_size,
        structured_output=config.structured_output.backend != "none"
        and bool(registry.names("structured_output")),
        tool_call_parser=config.server.tool_call_parser,
        playground=config.server.playground,
        cpu=cpu_report(),
        plugins=plugin_rows(config),
        failed_plugins=[
            FailedPlugin(plugin=p, distribution=d, error=r) for p, d, r in registry.failed
        ],
    )
