"""A real Ray cluster on this machine for the ``ray`` executor's tests: one per test package.

``ray.cluster_utils.Cluster`` starts a head node and a second node (each its own
raylet and object store), 2 logical CPUs each, so a TP=2 x PP=2 group (one CPU
per rank) spreads over both nodes. Starting it takes ~10-25 s on 2 cores, hence
one cluster for every test here. Everything listens on 127.0.0.1 (Ray's
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: no other address of this machine is used)
and no usage statistics are sent.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ray = pytest.importorskip("ray")

#: logical CPUs per node: 2 nodes x 2 fit TP=2 x PP=2 (and TP=3 for SmolLM2)
NODE_CPUS = 2


@pytest.fixture(scope="package")
def ray_cluster() -> Any:
    """A connected 2-node Ray cluster (head + one node), shut down after this package."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=NODE_CPUS)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def baton_actors(prefix: str = "baton-ray-") -> list[dict[str, str]]:
    """The rank actors alive in the cluster (executor ``id`` names them baton-ray-<id>-rank<r>)."""
    return [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    ]


def live_placement_groups(prefix: str = "baton-ray-") -> list[str]:
    """The placement groups not yet removed (executor ``id``'s is named baton-ray-<id>)."""
    return [
        pg_id
        for pg_id, pg in ray.util.placement_group_table().items()
        if pg["state"] != "REMOVED" and pg["name"].startswith(prefix)
    ]


def assert_nothing_left(executor: Any = None, timeout: float = 10.0) -> None:
    """No rank actor and no placement group of ``executor`` (default: of any) outlived it."""
    prefix = "baton-ray-" if executor is None else f"baton-ray-{executor.id}"
    deadline = time.monotonic() + timeout
    while (baton_actors(prefix) or live_placement_groups(prefix)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not baton_actors(prefix), f"actors left behind: {baton_actors(prefix)}"
    left = live_placement_groups(prefix)
    assert not left, f"placement groups left behind: {left}"


def ray_executor(**overrides: Any) -> Any:
    """The ``ray`` executor over the tiny model on the CPU, built as the engine builds it."""
    from baton.config import BatonConfig
    from baton.plugins.registry import get_registry
    from baton.testing.tiny_model import tiny_model

    cfg = BatonConfig.load(
        model=str(tiny_model("llama")),
        executor="ray",
        device="cpu",
        num_threads=1,
        kv_cache_memory="16MiB",
        **overrides,
    )
    entry = get_registry().get("executor", "ray")
    return entry.create(cfg, cfg.plugin_settings("executor", "ray", entry.settings_model))
