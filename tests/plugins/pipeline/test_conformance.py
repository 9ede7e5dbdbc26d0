"""The executor conformance suite for pipeline (pipeline_parallel_size=2 on CPU, gloo)."""

from __future__ import annotations

from tests.plugins.parallel_common import ParallelConformance


class TestPipelineConformance(ParallelConformance):
    overrides = {"executor": "pipeline", "pipeline_parallel_size": 2}
