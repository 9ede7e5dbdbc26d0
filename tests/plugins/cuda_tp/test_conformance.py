"""The executor conformance suite for cuda-tp (tensor_parallel_size=2 on CPU, gloo)."""

from __future__ import annotations

from tests.plugins.parallel_common import ParallelConformance


class TestCudaTPConformance(ParallelConformance):
    overrides = {"executor": "cuda-tp", "tensor_parallel_size": 2}
