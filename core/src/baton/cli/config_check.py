"""``baton config check [FILE]``: is this configuration valid? No model or tokenizer loads.

It builds the config as every command does (the file, ``BATON_*`` variables, the engine
flags and ``--set``), then runs ``baton.plugins.check.check_config_plugins``, the
check ``LLM`` / ``AsyncLLM`` and the engine core run before anything loads: the selected
plugins are installed, every plugin sub-table belongs to an installed plugin and passes its
settings model. It prints what is selected and exits 0, or prints the errors and exits 1.

Every problem is reported at once: a value the config model refuses (``cache.block_size =
0``) is listed, put back to its default, and the config built again, so that the plugin
check still runs on the rest. Only a refusal that names no single field (a check across
sections) stops it before the plugins are checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import pydantic

from baton.cli.main import add_engine_arguments, engine_overrides
from baton.config import BatonConfig
from baton.config.baton_config import CONFIG_ENV
from baton.config.messages import describe_error
from baton.config.overrides import all_section_models, nest_overrides
from baton.errors import BatonError, ConfigError
from baton.plugins.check import combined, find_plugin_problems
from baton.plugins.registry import get_registry

#: Passes of "reset the refused values, build again" (a pass may reveal a cross-field check).
MAX_PASSES = 4


def config_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Check a config file: its values, the plugins it selects and their settings (no model loads)."""
    p.add_argument("action", choices=["check"], help="check: validate the configuration")
    p.add_argument(
        "file", nargs="?", help="a TOML or YAML config file (default: --config or $BATON_CONFIG)"
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_engine_arguments(p)
    return run_check


def run_check(args: argparse.Namespace) -> int:
    """Check the configuration ``args`` describe; 0 when valid, 1 with the errors printed."""
    if args.file and args.config and args.file != args.config:
        raise ConfigError(
            f"two config files: {args.file!r} and --config {args.config!r}; give one of them"
        )
    path = args.file or args.config
    source = path or os.environ.get(CONFIG_ENV) or None  # the file BatonConfig.load reads
    registry = get_registry()
    config, problems = load_config(path, engine_overrides(args))
    selected = []
    if config is not None:
        selected, plugin_problems = find_plugin_problems(config, registry)
        problems += plugin_problems
    if problems:
        e = combined(problems)
        if args.json:
            shown = {"ok": False, "config": source, "error": str(e)}
            print(json.dumps(shown | {"problems": [str(p) for p in problems]}, indent=2))
        else:
            print(f"baton config check: {source or 'defaults'}: invalid", file=sys.stderr)
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            if config is None:
                print("(the plugins were not checked: fix the values first)", file=sys.stderr)
        return 1
    assert config is not None
    for plugin, dist, reason in registry.failed:
        print(f"warning: plugin {plugin!r} ({dist}) failed to load: {reason}", file=sys.stderr)
    rows: list[dict[str, Any]] = msgspec.to_builtins(selected)
    if args.json:
        print(
            json.dumps(
                {"ok": True, "config": source, "model": config.model.name, "selected": rows},
                indent=2,
            )
        )
        return 0
    print(f"config: {source or 'defaults'} (+ BATON_* variables and flags); valid")
    print(f"model: {config.model.name} (not loaded)")
    width = max((len(r["selected_by"]) for r in rows), default=0)
    for r in rows:
        print(f"{r['selected_by']:<{width}}  {r['name']}  ({r['distribution']} {r['version']})")
        if r["settings"] is not None:
            print(f"{'':<{width}}    settings: {json.dumps(r['settings'])}")
    return 0


def load_config(
    path: str | None, overrides: dict[str, Any]
) -> tuple[BatonConfig | None, list[BatonError]]:
    """The config, with each value the config model refused put back to its default, and one
    ConfigError per refused value; None for the config when a refusal names no field."""
    problems: list[BatonError] = []
    nested: dict[str, dict[str, Any]] = nest_overrides(overrides)
    reset: set[tuple[str, str]] = set()
    for _ in range(MAX_PASSES):
        try:
            return BatonConfig.load(path, **nested), problems
        except ConfigError as e:
            refused = e.__context__  # load raises ``from None``: the pydantic error stays here
            if not isinstance(refused, pydantic.ValidationError):
                return None, [*problems, e]  # no file, a syntax error
            header = str(e).split("\n", 1)[0].rstrip(":")
            for err in refused.errors():
                problems.append(ConfigError(f"{header}: {describe_error(err)}"))
                field = _field_of(err["loc"])
                if field is None or field[:2] in reset:  # no one field, or its default refused
                    return None, problems
                section, name, default = field
                nested.setdefault(section, {})[name] = default  # kept when None, unlike a flag
                reset.add((section, name))
    return None, problems


def _field_of(loc: tuple[Any, ...]) -> tuple[str, str, Any] | None:
    """(section, field, its default) for the field ``loc`` is in; None when ``loc`` names no
    field of a section (a check across fields or sections)."""
    sections = all_section_models()  # the sections plugins register too ([server])
    if len(loc) < 2 or loc[0] not in sections:
        return None
    fields = sections[str(loc[0])].model_fields
    name = next((n for n, f in fields.items() if loc[1] in (n, f.alias, f.validation_alias)), None)
    if name is None:
        return None
    return str(loc[0]), name, fields[name].get_default(call_default_factory=True)
