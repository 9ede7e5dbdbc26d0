"""sleep / wake_up with the pipeline executor: each stage frees and reloads its cut of the model."""

from __future__ import annotations

from tests.plugins.cuda_tp.test_sleep import check_ranks_sleep_and_wake


def test_both_stages_sleep_at_each_level_and_wake_with_the_same_tokens():
    check_ranks_sleep_and_wake(executor="pipeline", pipeline_parallel_size=2)
