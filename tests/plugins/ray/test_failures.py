"""Failures of the ``ray`` executor: a killed rank actor, a group the cluster cannot place,
ranks that see other plugins than the engine. Nothing is left behind in any case."""

from __future__ import annotations

import threading
import time

import pytest

from baton import LLM
from baton.errors import BatonError, EngineDeadError, ExecutorError
from tests.e2e.conftest import assert_a_death_fails_every_call
from tests.plugins.ray.conftest import (
    assert_nothing_left,
    baton_actors,
    live_placement_groups,
    ray,
    ray_executor,
)


def kill_an_actor_on_first_output(client, rank_suffix: str) -> list[float]:
    """ray.kill a rank actor as soon as the engine's first output arrives (the run is under way)."""
    killed_at: list[float] = []
    get_output = client.get_output

    def get_output_then_kill():
        out = get_output()
        if not killed_at:
            (victim,) = [a for a in baton_actors() if a["name"].endswith(rank_suffix)]
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
            killed_at.append(time.monotonic())
        return out

    client.get_output = get_output_then_kill
    return killed_at


def test_a_killed_rank_actor_is_engine_dead_within_5_s(ray_cluster):
    from baton.testing.tiny_model import tiny_model

    llm = LLM(
        model=str(tiny_model("llama")),
        transport="zmq",  # the engine core in its own process: it joins the cluster itself
        executor="ray",
        tensor_parallel_size=2,
        device="cpu",
        num_threads=1,
        max_model_len=2048,
        **{"executor.ray": {"address": ray_cluster.address}},
    )
    try:
        assert len(baton_actors()) == 2
        killed_at = kill_an_actor_on_first_output(llm.engine, "rank1")
        assert_a_death_fails_every_call(llm, killed_at, EngineDeadError)
    finally:
        llm.shutdown()
    assert_nothing_left()


def test_a_group_the_cluster_cannot_place_is_refused(ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(BatonError, match="could not place 2 bundles"):
        ray_executor(
            tensor_parallel_size=2, **{"executor.ray": {"num_cpus": 3, "placement_timeout": 1}}
        )
    assert time.monotonic() - t0 < 30
    assert not live_placement_groups() and not baton_actors()


def test_ranks_that_see_other_plugins_are_refused(ray_cluster):
    # the rank actors load only the built-in plugins: their set differs from the engine's
    with pytest.raises(BatonError, match="sees other plugins than the engine"):
        ray_executor(**{"executor.ray": {"env": {"BATON_DISABLE_PLUGIN_AUTOLOAD": "1"}}})
    assert_nothing_left()


@pytest.mark.slow
def test_the_death_of_a_node_fails_the_executor_within_5_s(ray_cluster):
    # a third node that only this executor's ranks may use (its custom resource)
    node = ray_cluster.add_node(num_cpus=2, resources={"baton_victim": 2})
    ex = ray_executor(
        tensor_parallel_size=2, **{"executor.ray": {"resources": {"baton_victim": 1}}}
    )
    try:
        failed = threading.Event()
        errors: list[BaseException] = []
        ex.register_failure_callback(lambda e: (errors.append(e), failed.set()))
        ex.check_health()
        t0 = time.monotonic()
        ray_cluster.remove_node(node, allow_graceful=False)  # raylet and both ranks killed
        assert failed.wait(10.0), "the node's death was not noticed"
        assert time.monotonic() - t0 < 5.0
        time.sleep(0.5)
        assert len(errors) == 1, errors
        with pytest.raises(ExecutorError):
            ex.check_health()
    finally:
        ex.shutdown()
    assert_nothing_left(ex)
