"""The override forms ``BatonConfig.load`` and ``replace`` accept, turned into section tables.

``LLM(max_num_seqs=8)``, ``LLM(**{"scheduler.policy": "priority"})``,
``LLM(scheduler={...})``, ``LLM(executor="cuda-tp")``: all become
``{section: {field: value}}``, merged table by table.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from baton import config_sections
from baton.config.sections import SECTION_MODELS
from baton.errors import ConfigError
from baton.plugins.kinds import BY_SECTION


def all_section_models() -> dict[str, type[BaseModel]]:
    """baton-core's sections, then those installed plugins register (``[server]``)."""
    return {**SECTION_MODELS, **config_sections.registered()}


def _flat_aliases(models: dict[str, type[BaseModel]]) -> dict[str, tuple[str, str]]:
    seen: dict[str, list[tuple[str, str]]] = {}
    for section, model in models.items():
        for field in model.model_fields:
            seen.setdefault(field, []).append((section, field))
    aliases = {k: v[0] for k, v in seen.items() if len(v) == 1}
    # a section's name for the field that selects its plugin: executor="cuda-tp"
    aliases.update(
        {s: (s, k.selector) for s, k in BY_SECTION.items() if k.selector is not None and not k.many}
    )
    aliases.update(
        model=("model", "name"),
        policy=("scheduler", "policy"),
        # vLLM's names: LLM(dtype=...) is the model's dtype, kv_cache_dtype the cache's
        dtype=("model", "dtype"),
        kv_cache_dtype=("cache", "dtype"),
    )
    return aliases


def nest_overrides(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Turn the override forms ``load`` accepts into ``{section: {field: value}}``."""
    models = all_section_models()
    sections = tuple(models)
    aliases = _flat_aliases(models) if overrides else {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if value is None:
            continue  # unset CLI flags and defaulted keyword arguments
        if key in sections and isinstance(value, dict | BaseModel):
            data = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
            nested[key] = deep_merge(nested.get(key, {}), data)
        elif "." in key:
            section, *path = key.split(".")
            if section not in sections:
                raise ConfigError(
                    f"{key!r}: unknown section {section!r} (sections: {', '.join(sections)})"
                )
            if not all(path):
                raise ConfigError(
                    f"{key!r}: an empty name between dots; use 'section.field' or "
                    "'section.plugin.setting', e.g. scheduler.max_num_seqs"
                )
            _set_path(nested.setdefault(section, {}), path, value, key)
        elif key in aliases:
            section, field = aliases[key]
            nested.setdefault(section, {})[field] = value
        else:
            raise ConfigError(
                f"unknown setting {key!r}: use a field name such as max_num_seqs, a dotted "
                f"'section.field', or a section dict (sections: {', '.join(sections)})"
            )
    return nested


def _set_path(table: dict[str, Any], path: list[str], value: Any, key: str) -> None:
    """``table[a][b]... = value`` for ``path`` [a, b, ...]: ``scheduler.edf.x`` sets key ``x``
    of the ``edf`` sub-table; tables on the way are created or merged, never replaced."""
    *tables, last = path
    for i, name in enumerate(tables):
        inner = table.setdefault(name, {})
        if not isinstance(inner, dict):
            where = ".".join([key.split(".")[0], *tables[: i + 1]])
            raise ConfigError(f"{key!r}: {where} is a setting ({inner!r}), not a table of settings")
        table = inner
    old = table.get(last)
    if isinstance(value, dict):
        table[last] = deep_merge(old if isinstance(old, dict) else {}, value)
    elif isinstance(old, dict) and old:
        raise ConfigError(f"{key!r}: a table of settings cannot be set to {value!r}")
    else:
        table[last] = value


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys, tables merged key by key (a new dict; neither argument
    nor any table in them is changed)."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict):
            below = out.get(k)
            out[k] = deep_merge(below if isinstance(below, dict) else {}, v)
        else:
            out[k] = v
    return out
