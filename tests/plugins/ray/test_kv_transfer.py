"""The KV-connector seam over the ``ray`` executor's ranks (actors): two tensor-parallel ranks
serve a prompt the pool forgot from the reference connector, with the tokens of connector off.
Its own local Ray instance, in a fresh process (tests/core/test_kv_transfer_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.test_kv_transfer_workers import run_two_ranks

PRELUDE = """
import os
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
"""


@pytest.mark.slow
def test_the_seam_over_ray_actors(tmp_path: Path) -> None:
    run_two_ranks(tmp_path, "ray", asynchronous=True, prelude=PRELUDE)
