"""Plugin module of baton-bench: registers the benchmarks ``scheduler``, ``simulate``,
``transport``, ``throughput``, ``latency``, ``serve`` and ``multiturn`` (``baton bench <name>``).

Plugins load in every process baton spawns (engine cores too), so this module
imports no benchmark: each one's module loads when ``baton bench`` builds its parser.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any, cast

from baton import hookimpl

BATON_PLUGIN_API = 1

Handler = Callable[[argparse.Namespace], int | None]

#: benchmark -> module with add_arguments(parser) and main(args)
BENCHES = {
    "scheduler": "baton_bench.scheduler",
    "simulate": "baton_bench.simulate",
    "transport": "baton_bench.transport",
    "throughput": "baton_bench.throughput",
    "latency": "baton_bench.latency",
    "serve": "baton_bench.serve",
    "multiturn": "baton_bench.multiturn",
}


class ModuleBench:
    """The bench factory of a module with ``add_arguments(parser)`` and ``main(args)``, imported
    only when ``baton bench`` builds its parser (plugins load in every process)."""

    def __init__(self, module_name: str) -> None:
        self.module_name = module_name

    @property  # type: ignore[override]
    def __doc__(self) -> str | None:  # the help line: the module's docstring
        return importlib.import_module(self.module_name).__doc__

    def __call__(self, parser: argparse.ArgumentParser) -> Handler:
        module = importlib.import_module(self.module_name)
        module.add_arguments(parser)
        return cast(Handler, module.main)


@hookimpl
def register_benches(register: Any) -> None:
    for name, module_name in BENCHES.items():
        register(name, ModuleBench(module_name))
