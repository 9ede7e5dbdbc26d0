"""``baton config check [FILE]``: is this configuration valid? No model or tokenizer loads.

It builds the config as every command does (the file, ``BATON_*`` variables, the engine
flags and ``--set``), then runs ``baton.engine.plugin_check.check_config_plugins``, the
check ``LLM`` / ``AsyncLLM`` and the engine core run before anything loads: the selected
plugins are installed, every plugin sub-table belongs to an installed plugin and passes its
settings model. It prints what is selected and exits 0, or prints the errors and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from baton.cli.main import add_engine_arguments, engine_overrides
from baton.errors import BatonError, ConfigError


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
    from baton.config import CONFIG_ENV, BatonConfig
    from baton.engine.plugin_check import check_config_plugins
    from baton.plugins import get_registry

    if args.file and args.config and args.file != args.config:
        raise ConfigError(
            f"two config files: {args.file!r} and --config {args.config!r}; give one of them"
        )
    path = args.file or args.config
    source = path or os.environ.get(CONFIG_ENV) or None  # the file BatonConfig.load reads
    registry = get_registry()
    try:
        config = BatonConfig.load(path, **engine_overrides(args))
        selected = check_config_plugins(config, registry)
    except BatonError as e:
        if args.json:
            print(json.dumps({"ok": False, "config": source, "error": str(e)}, indent=2))
        else:
            print(f"baton config check: {source or 'defaults'}: invalid", file=sys.stderr)
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
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
