"""The ``baton`` command. Subcommands come from plugins (register_commands hooks)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from baton.errors import BatonError
from baton.plugins.moved import retired

#: The environment variable giving the CLI's default log level.
LOG_LEVEL_ENV = "BATON_LOG_LEVEL"


#: The named engine flags add_engine_arguments adds (argparse dests; besides --set).
_ENGINE_FLAGS = (
    "model",
    "dtype",
    "max_model_len",
    "transport",
    "executor",
    "device",
    "policy",
    "max_num_seqs",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "data_parallel_backend",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The config overrides every engine-running command accepts (strongest source)."""
    g = parser.add_argument_group("engine (overrides the config file and BATON_* variables)")
    g.add_argument("--model", help="built-in alias, HF model folder or .gguf file")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--transport", help="inproc | zmq | shm | any installed")
    g.add_argument("--executor", help="uniproc | cuda-tp | pipeline | any installed")
    g.add_argument("--device", help="cpu | cuda | cuda:N | auto")
    g.add_argument("--policy", help="scheduler policy: fcfs | priority | any installed")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--tensor-parallel-size", "--tp", type=int)
    g.add_argument("--pipeline-parallel-size", "--pp", type=int)
    g.add_argument(
        "--data-parallel-size",
        "--dp",
        type=int,
        help="engine cores, each with the whole model, behind one asyncio frontend (baton serve)",
    )
    g.add_argument(
        "--data-parallel-backend",
        help="where engine cores run: mp (local processes) | ray (Ray actors, baton-plugin-ray) "
        "| any installed engine launcher (executor.data_parallel_backend)",
    )
    g.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters (PEFT folders) on top of the model (lora.enable_lora)",
    )
    g.add_argument("--max-loras", type=int, help="most LoRA adapters in one batch (lora.max_loras)")
    g.add_argument(
        "--max-lora-rank", type=int, help="the highest LoRA rank accepted (lora.max_lora_rank)"
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        help="LoRA adapters kept loaded in host memory (lora.max_cpu_loras)",
    )
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="any other setting, e.g. --set cache.block_size=32 (repeatable)",
    )


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The overrides for BatonConfig.load from add_engine_arguments' flags."""
    overrides: dict[str, Any] = {n: getattr(args, n, None) for n in _ENGINE_FLAGS}
    # --dtype is the model's: a bare "dtype" is ambiguous since cache.dtype
    overrides["model.dtype"] = overrides.pop("dtype")
    for item in getattr(args, "set", None) or ():
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise BatonError(
                f"--set {item!r}: use SECTION.FIELD=VALUE, e.g. --set cache.block_size=32"
            )
        overrides[key.strip()] = value.strip()
    return overrides


def engine_argv(args: argparse.Namespace) -> list[str]:
    """add_engine_arguments' flags given in ``args``, as command-line arguments again: for a
    command that starts another baton command (``baton serve``) on the same engine."""
    argv: list[str] = []
    for name in _ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is True:  # a switch (--enable-lora)
            argv.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    for item in getattr(args, "set", None) or ():
        argv += ["--set", item]
    return argv


__getattr__ = retired(
    __name__, {"ENGINE_FLAGS": ("_ENGINE_FLAGS", "engine_argv(args) or engine_overrides(args)")}
)


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    from baton.config.sections import LOG_LEVELS

    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help=f"log level of this process (any case; default ${LOG_LEVEL_ENV} or WARNING)",
    )


def build_parser() -> argparse.ArgumentParser:
    from baton import __version__
    from baton.plugins.registry import get_registry

    parser = argparse.ArgumentParser(
        prog="baton", description="baton: a plugin-first LLM inference engine"
    )
    parser.add_argument("--version", action="version", version=f"baton {__version__}")
    _add_log_level(parser, default=os.environ.get(LOG_LEVEL_ENV, "WARNING"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in get_registry().of_kind("command"):
        p = sub.add_parser(
            entry.name, help=(entry.factory.__doc__ or "").strip().splitlines()[0] or None
        )
        p.add_argument("--config", help="a TOML or YAML config file (default: $BATON_CONFIG)")
        _add_log_level(
            p, default=argparse.SUPPRESS
        )  # also after the command: baton generate --log-level
        p.set_defaults(_handler=entry.create(p), _entry=entry)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        from baton.config.sections import LOG_LEVELS

        if args.log_level not in LOG_LEVELS:  # a default from the environment skips the choices
            parser.error(
                f"{LOG_LEVEL_ENV}={os.environ.get(LOG_LEVEL_ENV)!r} is not a log level: use one of "
                f"{', '.join(LOG_LEVELS)}"
            )
        logging.basicConfig(
            level=args.log_level,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        if not getattr(args, "_handler", None):
            parser.print_help()
            return 2
        return int(args._handler(args) or 0)
    except BatonError as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
