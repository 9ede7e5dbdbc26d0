"""``baton serve``: the flags, the config, the run."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from typing import Any

from baton.cli.main import add_engine_arguments, engine_overrides


def api_key(value: str) -> str:
    """--api-key's type: an empty or blank key would let an empty bearer token in."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            "an empty or blank API key would let any bearer token in: give a real key, "
            "or leave --api-key out for no authentication"
        )
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server (overrides [server] of the config)")
    g.add_argument("--host", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port to bind (default 8000; 0 = a free one)")
    g.add_argument("--served-model-name", help="the model name clients send (default: model.name)")
    g.add_argument(
        "--api-key",
        type=api_key,
        help="require 'Authorization: Bearer <key>' on /v1 routes (not empty)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        help="seconds in-flight requests may take to finish on SIGTERM before they are aborted "
        "(default 30, unlike the library's 0; 0 aborts them at once)",
    )
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument(
        "--chat-template",
        help="a chat template to use instead of the tokenizer's: a Jinja file's path, or the "
        "template itself (server.chat_template)",
    )
    g.add_argument(
        "--otlp-traces-endpoint",
        help="send an OpenTelemetry span per request to this OTLP endpoint, e.g. "
        "http://127.0.0.1:4317 (observability.otlp_traces_endpoint; needs baton-core[otel])",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        metavar="NAME=PATH",
        help="LoRA adapters served as model names from the start (server.lora_modules; needs "
        "--enable-lora)",
    )
    add_engine_arguments(p)


def lora_module(value: str) -> tuple[str, str]:
    """--lora-modules' type: ``name=path`` (vLLM's form; its JSON form too)."""
    text = value.strip()
    if text.startswith("{"):
        import json

        try:
            obj = json.loads(text)
            return str(obj["name"]), str(obj["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'{value!r}: give name=path or {{"name": ..., "path": ...}}'
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{value!r}: give name=path, e.g. sql=/adapters/sql")
    return name.strip(), path.strip()


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = engine_overrides(args)
    for flag, key in (
        ("host", "server.host"),
        ("port", "server.port"),
        ("served_model_name", "server.served_model_name"),
        ("api_key", "server.api_key"),
        ("shutdown_timeout", "server.shutdown_timeout"),
        ("chat_template", "server.chat_template"),
        ("otlp_traces_endpoint", "observability.otlp_traces_endpoint"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    if getattr(args, "lora_modules", None):
        overrides["server.lora_modules"] = dict(args.lora_modules)
    return overrides


def _show_server_logs() -> None:
    # the CLI's default level is WARNING; a server should still say where it listens and how it is doing
    level = min(logging.getLogger().getEffectiveLevel(), logging.INFO)
    for name in ("baton_openai", "baton.stats", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(level)


def run_serve(args: argparse.Namespace) -> int:
    from baton.config import BatonConfig
    from baton_openai.http.server import OpenAIServer

    config = BatonConfig.load(args.config, **serve_overrides(args))
    _show_server_logs()
    if config.server.log_format == "json":
        from baton_openai.http.json_logs import use_json_logs

        use_json_logs()
    if args.access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = OpenAIServer(config, access_log=args.access_log)
    code = asyncio.run(server.run())
    # Everything is stopped; what is left is the interpreter's final garbage collection, which
    # takes seconds with torch and a model loaded: objects that live to the exit are left to the OS
    gc.disable()
    gc.freeze()
    return code
