"""Built-in CLI commands: generate, chat, plugins, bench, config, env (a plugin module like any
other)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from baton import SamplingParams
from baton.cli.config_check import config_command
from baton.cli.main import add_engine_arguments, engine_overrides
from baton.errors import InvalidRequestError, PluginNotFoundError
from baton.plugins.hookspecs import hookimpl
from baton.plugins.registry import get_registry
from baton.scheduling_info import as_scheduling_info
from baton.validation import check_scheduling

Handler = Callable[[argparse.Namespace], int | None]


def _add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")


def _sampling_params(args: argparse.Namespace) -> Any:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )


def _add_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling (what the scheduler policy may read)")
    g.add_argument("--priority", type=int, default=0, help="lower runs first with 'priority'")
    g.add_argument(
        "--deadline", type=float, metavar="SECONDS", help="finish within this long of arrival"
    )
    g.add_argument("--tenant", help="who the request is for (the 'fair' policy's key)")
    g.add_argument(
        "--slo-ttft-ms",
        type=float,
        metavar="MS",
        help="time-to-first-token target (the 'slo' policy)",
    )
    g.add_argument(
        "--slo-tpot-ms", type=float, metavar="MS", help="time-per-output-token target ('slo')"
    )
    g.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a free-form tag for the policy (repeatable)",
    )


def _scheduling(args: argparse.Namespace) -> Any:
    """The SchedulingInfo of the scheduling flags, checked before any model loads."""
    tags: dict[str, str] = {}
    for item in args.tag:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequestError(
                f"--tag {item!r}: use KEY=VALUE, e.g. --tag team=search", param="scheduling.tags"
            )
        tags[key] = value
    info = as_scheduling_info(
        {
            "priority": args.priority,
            "deadline": args.deadline,
            "tenant": args.tenant,
            "tags": tags,
            "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms,
        }
    )
    check_scheduling(info)
    return info


def generate_command(p: argparse.ArgumentParser) -> Handler:
    """Complete prompts with a model and print the text."""
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(p)
    _add_sampling_arguments(p, max_tokens=64)
    _add_scheduling_arguments(p)

    def run(args: argparse.Namespace) -> int:
        # the engine's modules load when a command runs, not with every process's plugins
        from baton import LLM

        scheduling = _scheduling(args)
        with LLM(config=args.config, **engine_overrides(args)) as llm:
            outs = llm.generate(
                args.prompts, _sampling_params(args), use_tqdm=False, scheduling=scheduling
            )
        for o in outs:
            c = o.outputs[0]
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": o.prompt,
                            "text": c.text,
                            "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                        }
                    )
                )
            else:
                print(c.text)
        return 0

    return run


def chat_command(p: argparse.ArgumentParser) -> Handler:
    """Chat with a model: one --message, or an interactive conversation on stdin."""
    p.add_argument("--message", "-m", help="answer this one message and exit")
    p.add_argument("--system", help="a system prompt")
    add_engine_arguments(p)
    _add_sampling_arguments(p, max_tokens=256)
    _add_scheduling_arguments(p)

    def run(args: argparse.Namespace) -> int:
        # the engine's modules load when a command runs, not with every process's plugins
        from baton import LLM

        params = _sampling_params(args)
        scheduling = _scheduling(args)
        history: list[dict[str, str]] = (
            [{"role": "system", "content": args.system}] if args.system else []
        )
        with LLM(config=args.config, **engine_overrides(args)) as llm:
            while True:
                if args.message is not None:
                    text = args.message
                else:
                    try:
                        text = input("you> ")
                    except EOFError:
                        return 0
                    if not text.strip():
                        continue
                history.append({"role": "user", "content": text})
                outs = llm.chat(history, params, use_tqdm=False, scheduling=scheduling)
                answer = outs[0].outputs[0].text.strip()
                history.append({"role": "assistant", "content": answer})
                print(answer if args.message is not None else f"baton> {answer}", flush=True)
                if args.message is not None:
                    return 0

    return run


def plugins_command(p: argparse.ArgumentParser) -> Handler:
    """List installed plugins: kind, name, distribution, version."""
    p.add_argument("--json", action="store_true")

    def run(args: argparse.Namespace) -> int:
        reg = get_registry()
        rows = [
            {
                "kind": e.kind,
                "name": e.name,
                "distribution": e.distribution,
                "version": e.version,
                "plugin": e.plugin,
            }
            for e in sorted(reg.entries.values(), key=lambda e: (e.kind, e.name))
        ]
        failed = [{"plugin": p, "distribution": d, "error": r} for p, d, r in reg.failed]
        if args.json:
            print(json.dumps({"plugins": rows, "failed": failed}, indent=2))
            return 0
        width = max((len(r["kind"]) for r in rows), default=4)
        for r in rows:
            print(f"{r['kind']:<{width}}  {r['name']:<12} {r['distribution']} {r['version']}")
        for f in failed:
            print(f"FAILED  {f['plugin']} ({f['distribution']}): {f['error']}", file=sys.stderr)
        return 0

    return run


def env_command(p: argparse.ArgumentParser) -> Handler:
    """Print the CPU's features, what the OS grants, and the path each kernel takes and why."""
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--no-build", action="store_true", help="do not compile the kernels if they are not built"
    )

    def run(args: argparse.Namespace) -> int:
        import msgspec

        # torch loads here, not when the CLI's plugins load in every process
        from baton.kernels.report import collect, render

        report = collect(build_kernels=not args.no_build)
        if args.json:
            print(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
        else:
            print(render(report))
        return 0

    return run


def _no_bench(args: argparse.Namespace) -> int:
    raise PluginNotFoundError(
        "`baton bench`: no benchmark is installed; install the distribution that provides "
        "them: pip install baton-bench (from a checkout: pip install -e ./plugins/bench)"
    )


def bench_command(p: argparse.ArgumentParser) -> Handler:
    """Benchmarks: scheduler, simulate, transport, throughput, latency, and those plugins register."""
    entries = get_registry().of_kind("bench")
    if not entries:  # `baton --help` and the other commands still work without baton-bench
        return _no_bench
    sub = p.add_subparsers(dest="bench", metavar="KIND", required=True)
    for entry in entries:
        doc = (entry.factory.__doc__ or "").strip()
        bp = sub.add_parser(entry.name, help=doc.splitlines()[0] if doc else None)
        bp.set_defaults(_bench_main=entry.create(bp))

    def run(args: argparse.Namespace) -> int:
        return int(args._bench_main(args) or 0)

    return run


@hookimpl
def register_commands(register: Any) -> None:
    register("generate", generate_command)
    register("chat", chat_command)
    register("plugins", plugins_command)
    register("bench", bench_command)
    register("config", config_command)
    register("env", env_command)
