"""The scheduler simulator: replay a workload (a file or a generator) through the real scheduler, no model.

``baton bench simulate`` is ``baton bench scheduler --workload`` with the
workload a positional-free default (``poisson``): TTFT, ITL, throughput,
preemptions, recomputed tokens and, with ``--slo-ttft-ms`` / ``--slo-tpot-ms``,
goodput, for each ``--policy`` side by side (``baton_bench.simulator_cli``).
"""

from __future__ import annotations

import argparse

from baton_bench import scheduler, simulator_cli


def add_arguments(p: argparse.ArgumentParser) -> None:
    scheduler.add_arguments(p)
    p.set_defaults(workload="poisson")


def main(args: argparse.Namespace) -> int:
    return simulator_cli.main(args)
