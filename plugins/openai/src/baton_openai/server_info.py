"""What the dashboard shows about the server beside the engine's figures: the model, the loaded
plugins (with their distributions and settings), the CPU path of the kernels, the versions."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from baton import __version__
from baton.config import BatonConfig
from baton.errors import BatonError
from baton.kernels.loader import ISA_ENV, isa_flags
from baton.plugin_kinds import PLUGIN_KINDS
from baton.plugins import get_registry
from baton.protocol import ModelInfo
from baton.worker.cpu_features import cpu_features
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


class CpuPath(msgspec.Struct, kw_only=True):
    """The CPU the server runs on and the instruction set the kernels are compiled for."""

    cpu: str
    """``CpuFeatures.describe()``: the architecture and the flags that matter."""
    kernel_isa: str
    """$BATON_KERNEL_ISA (native by default)."""
    kernel_flags: list[str]
    """The -m flags that ISA compiles with (empty, with ``error``, for an unknown one)."""
    error: str | None = None


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
    cpu: CpuPath
    plugins: list[PluginRow]
    failed_plugins: list[FailedPlugin]


def cpu_path() -> CpuPath:
    """This machine's CPU and the kernels' instruction set (a richer report can replace this)."""
    isa = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    try:
        flags, error = list(isa_flags()), None
    except BatonError as e:  # an ISA the kernels do not know (KernelBuildError)
        flags, error = [], str(e)
    return CpuPath(cpu=cpu_features().describe(), kernel_isa=isa, kernel_flags=flags, error=error)


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
        cpu=cpu_path(),
        plugins=plugin_rows(config),
        failed_plugins=[
            FailedPlugin(plugin=p, distribution=d, error=r) for p, d, r in registry.failed
        ],
    )
