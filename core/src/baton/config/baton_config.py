"""``BatonConfig``: the sections together, their sources, the checks across sections, and the
plugin settings sub-tables.

Sources, strongest first: explicit arguments (``LLM(**overrides)``, CLI flags),
``BATON_<SECTION>__<FIELD>`` environment variables, a TOML or YAML file (given
with ``--config`` or ``BATON_CONFIG``), defaults.
"""

from __future__ import annotations

import contextvars
import functools
import os
from pathlib import Path
from typing import Any

import pydantic
from pydantic import BaseModel, Field
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from baton import config_sections
from baton.config import sections
from baton.config.messages import format_validation_error
from baton.config.overrides import deep_merge, nest_overrides
from baton.errors import ConfigError
from baton.plugins.kinds import BY_SECTION

CONFIG_ENV = "BATON_CONFIG"

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "baton_config_file", default=None
)


class BatonConfig(BaseSettings):
    """All of baton's settings. Build it with ``BatonConfig.load(...)``."""

    # extra keys hold the sections plugins register (``config.server``): each validated with
    # its plugin's model by ``_plugin_sections``, any other key refused there
    model_config = SettingsConfigDict(
        env_prefix="BATON_",
        env_nested_delimiter="__",
        extra="allow",
        validate_assignment=True,
    )

    model: sections.ModelSection = Field(default_factory=sections.ModelSection)
    cache: sections.CacheSection = Field(default_factory=sections.CacheSection)
    scheduler: sections.SchedulerSection = Field(default_factory=sections.SchedulerSection)
    executor: sections.ExecutorSection = Field(default_factory=sections.ExecutorSection)
    transport: sections.TransportSection = Field(default_factory=sections.TransportSection)
    structured_output: sections.StructuredOutputSection = Field(
        default_factory=sections.StructuredOutputSection
    )
    speculative: sections.SpeculativeSection = Field(default_factory=sections.SpeculativeSection)
    kv_transfer: sections.KVTransferSection = Field(default_factory=sections.KVTransferSection)
    routing: sections.RoutingSection = Field(default_factory=sections.RoutingSection)
    lora: sections.LoRASection = Field(default_factory=sections.LoRASection)
    kv_events: sections.KVEventsSection = Field(default_factory=sections.KVEventsSection)
    observability: sections.ObservabilitySection = Field(
        default_factory=sections.ObservabilitySection
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        plugins = config_sections.registered()
        if plugins:
            sources.append(EnvSettingsSource(_plugin_env_model(tuple(plugins.items()))))
        path = _config_file.get()
        if path is not None:
            if path.suffix in (".yaml", ".yml"):
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
            else:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @pydantic.model_validator(mode="wrap")
    @classmethod
    def _plugin_sections(
        cls, data: Any, handler: pydantic.ModelWrapValidatorHandler[BatonConfig]
    ) -> BatonConfig:
        """baton-core's sections by the handler, each plugin's section by its model (also when
        absent: its defaults), every refusal of both together, then the plugins' checks across
        sections (``check_config``)."""
        plugins = config_sections.registered()
        if not isinstance(data, dict):
            return handler(data)
        errors: list[Any] = [
            {"type": "extra_forbidden", "loc": (key,), "input": value}
            for key, value in data.items()
            if key not in cls.model_fields and key not in plugins
        ]
        tables: dict[str, BaseModel] = {}
        for name, model in plugins.items():
            try:
                tables[name] = model.model_validate(data.get(name, {}))
            except pydantic.ValidationError as e:
                errors += [_line_error(err, name) for err in e.errors()]
        try:
            config = handler({k: v for k, v in data.items() if k in cls.model_fields})
        except pydantic.ValidationError as e:
            if not errors:
                raise
            errors = [_line_error(err) for err in e.errors()] + errors
            raise pydantic.ValidationError.from_exception_data(cls.__name__, errors) from None
        if errors:
            raise pydantic.ValidationError.from_exception_data(cls.__name__, errors)
        assert config.__pydantic_extra__ is not None  # extra="allow"
        config.__pydantic_extra__.update(tables)
        for table in tables.values():
            check = getattr(table, "check_config", None)
            if check is not None:
                check(config)
        return config

    @property
    def serving(self) -> sections.ServingSettings:
        """What the kernel reads from the serving plugin's section (its ``serving_settings()``:
        the drain time on shutdown, the served model name); the library's defaults without one."""
        for table in (self.model_extra or {}).values():
            provide = getattr(table, "serving_settings", None)
            if provide is not None:
                return provide()  # type: ignore[no-any-return]
        return sections.ServingSettings()

    @property
    def served_model_name(self) -> str:
        """The model name clients use (``serving.served_model_name``, else ``model.name``)."""
        return self.serving.served_model_name or self.model.name

    @pydantic.model_validator(mode="after")
    def _quantization_without_tensor_parallel(self) -> BatonConfig:
        q, tp = self.model.quantization, self.executor.tensor_parallel_size
        if q in ("int8", "int4") and tp > 1:
            raise ValueError(
                f"model.quantization={q!r} with executor.tensor_parallel_size={tp}: tensor-parallel "
                "shards are not quantized in this version; use tensor_parallel_size = 1 (a "
                "pipeline's stages are quantized) or model.quantization = 'none'"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _batch_invariant_where_it_holds(self) -> BatonConfig:
        ex = self.executor
        if not ex.batch_invariant:
            return self
        why = [
            f"{name}={value!r}: {reason}"
            for name, value, bad, reason in (
                (
                    "executor.device",
                    ex.device,
                    ex.device.startswith("cuda"),
                    "the invariant kernels are CPU kernels (set device = 'cpu')",
                ),
                (
                    "executor.pipeline_parallel_size",
                    ex.pipeline_parallel_size,
                    ex.pipeline_parallel_size > 1,
                    "pipeline stages run transformers' modules, not the invariant layer stack",
                ),
                (
                    "executor.expert_parallel",
                    ex.expert_parallel,
                    ex.expert_parallel,
                    "mixture-of-experts layers are not in the invariant layer stack",
                ),
                (
                    "executor.cpu_kernels",
                    ex.cpu_kernels,
                    not ex.cpu_kernels,
                    "the invariant path is baton's C++ kernels",
                ),
                (
                    "executor.fast_decode",
                    ex.fast_decode,
                    not ex.fast_decode,
                    "every step runs fast_decode's native layer stack",
                ),
                (
                    "lora.enable_lora",
                    self.lora.enable_lora,
                    self.lora.enable_lora,
                    "steps with adapters run transformers' modules",
                ),
                (
                    "model.dtype",
                    self.model.dtype,
                    self.model.dtype in ("bfloat16", "float16"),
                    "the invariant kernels compute in float32",
                ),
            )
            if bad
        ]
        if why:
            raise ValueError(
                "executor.batch_invariant = true cannot hold with "
                + "; ".join(why)
                + ". Change those settings or set batch_invariant = false"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _lora_without_model_parallel(self) -> BatonConfig:
        if not self.lora.enable_lora:
            return self
        ex = self.executor
        for name, size in (
            ("tensor_parallel_size", ex.tensor_parallel_size),
            ("pipeline_parallel_size", ex.pipeline_parallel_size),
        ):
            if size > 1:
                raise ValueError(
                    f"lora.enable_lora with executor.{name}={size}: LoRA adapters run on one "
                    f"rank holding the whole model in this version; set {name} = 1 (data "
                    "parallel engines each serve adapters) or lora.enable_lora = false"
                )
        return self

    @pydantic.model_validator(mode="after")
    def _kv_event_ports_per_rank(self) -> BatonConfig:
        """Each data-parallel engine binds the ports plus its rank: the two ranges must not meet."""
        ev, n = self.kv_events, self.executor.data_parallel_size
        if not ev.enable_kv_cache_events or ev.publisher != "zmq":
            return self
        ports = [
            (name, p)
            for name, value in (("endpoint", ev.endpoint), ("replay_endpoint", ev.replay_endpoint))
            if value is not None and (p := sections.endpoint_port(value)) is not None
        ]
        for name, p in ports:
            if p + n - 1 > 65535:
                raise ValueError(
                    f"kv_events.{name} port {p} with executor.data_parallel_size={n}: engine "
                    f"{n - 1} would bind port {p + n - 1}; use a port <= {65536 - n}"
                )
        if len(ports) == 2 and abs(ports[0][1] - ports[1][1]) < n:
            (_, p), (_, r) = ports
            raise ValueError(
                f"kv_events.endpoint port {p} and replay_endpoint port {r} with "
                f"executor.data_parallel_size={n}: each engine binds both plus its rank "
                f"({p}..{p + n - 1} and {r}..{r + n - 1}), which meet; put the replay port at "
                f"least {n} away (e.g. {p + n})"
            )
        return self

    # ------------------------------------------------------------------ build

    @classmethod
    def load(cls, config: str | os.PathLike[str] | None = None, **overrides: Any) -> BatonConfig:
        """Build the config from defaults, the file, the environment and ``overrides``.

        ``config`` is a TOML/YAML path (default: ``$BATON_CONFIG``). ``overrides``
        take section dicts (``scheduler={"policy": "priority"}``), dotted keys
        (``**{"scheduler.policy": "priority"}``), unambiguous field names
        (``max_num_seqs=8``) or a section name for its plugin/name field
        (``model="path"``, ``transport="zmq"``, ``executor="cuda-tp"``).
        """
        path = config if config is not None else os.environ.get(CONFIG_ENV) or None
        file: Path | None = None
        if path is not None:
            file = Path(path).expanduser()
            if not file.is_file():
                raise ConfigError(
                    f"config file {str(file)!r} does not exist (from --config or ${CONFIG_ENV})"
                )
            if file.suffix not in (".toml", ".yaml", ".yml"):
                raise ConfigError(f"config file {str(file)!r}: use a .toml, .yaml or .yml file")
        nested = nest_overrides(overrides)
        token = _config_file.set(file)
        try:
            return cls(**nested)
        except pydantic.ValidationError as e:
            raise ConfigError(format_validation_error(e, source=file)) from None
        except ValueError as e:  # a TOML/YAML syntax error
            raise ConfigError(f"config file {str(file)!r} could not be parsed: {e}") from e
        finally:
            _config_file.reset(token)

    def replace(self, **overrides: Any) -> BatonConfig:
        """A copy with ``overrides`` applied (same forms as ``load``), validated."""
        data = self.model_dump()
        for section, values in nest_overrides(overrides).items():
            data[section] = deep_merge(data.get(section, {}), values)
        try:
            return type(self).model_validate(data)
        except pydantic.ValidationError as e:
            raise ConfigError(format_validation_error(e)) from None

    # ---------------------------------------------------------------- plugins

    def plugin_settings(
        self, section: str, name: str, model: type[BaseModel] | None
    ) -> BaseModel | None:
        """Validate the ``[section.name]`` sub-table with the plugin's settings model.

        A key the model has no field (or alias) for is refused here, whatever the model's own
        ``extra`` setting says: a misspelt setting must not be ignored.
        """
        raw = (getattr(self, section).model_extra or {}).get(name, {})
        record = BY_SECTION.get(section)
        plugin = f"{record.word if record else 'plugin'} {name!r}"
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{section}.{name} must be a table of settings ([{section}.{name}]), got {raw!r}"
            )
        if model is None:
            if raw:
                raise ConfigError(
                    f"{section}.{name}: {plugin} takes no settings, got "
                    f"{', '.join(map(repr, raw))}: remove the [{section}.{name}] table"
                )
            return None
        known = settings_keys(model)
        unknown = [key for key in raw if key not in known]
        if unknown:
            paths = ", ".join(f"{section}.{name}.{key}" for key in unknown)
            raise ConfigError(
                f"{paths}: unknown setting{'s' * (len(unknown) > 1)} of {plugin} (its settings: "
                f"{', '.join(model.model_fields) or 'none'}): fix the key or remove it"
            )
        try:
            return model.model_validate(raw)
        except pydantic.ValidationError as e:
            raise ConfigError(format_validation_error(e, prefix=f"{section}.{name}")) from None


class _PluginEnv(BaseSettings):
    """Reads the plugin sections' ``BATON_<SECTION>__<FIELD>`` variables as BatonConfig reads its
    own (nested, lists and tables as JSON); never built, only its env source runs."""

    model_config = SettingsConfigDict(
        env_prefix="BATON_", env_nested_delimiter="__", extra="ignore"
    )


@functools.lru_cache(maxsize=8)
def _plugin_env_model(plugins: tuple[tuple[str, type[BaseModel]], ...]) -> type[BaseSettings]:
    """A settings class with one field per plugin section, for their environment variables."""
    fields: dict[str, Any] = {name: (model | None, None) for name, model in plugins}
    return pydantic.create_model("BatonPluginSections", __base__=_PluginEnv, **fields)


def _line_error(error: Any, section: str | None = None) -> Any:
    """A pydantic error as ``ValidationError.from_exception_data`` takes it, under ``section``:
    same type and message (a custom error: types such as ``byte_size`` are not pydantic's own)."""
    loc = tuple(error["loc"]) if section is None else (section, *error["loc"])
    kind = PydanticCustomError(error["type"], error["msg"])
    return {"type": kind, "loc": loc, "input": error["input"]}


def settings_keys(model: type[BaseModel]) -> set[str]:
    """The keys a settings model has a field for: field names and their string aliases."""
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                keys.add(alias)
            elif isinstance(alias, pydantic.AliasChoices):
                keys.update(c for c in alias.choices if isinstance(c, str))
    return keys
