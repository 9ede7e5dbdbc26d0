"""Pipeline parallel on CUDA with NCCL send/recv: one GPU per stage. Skipped without two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from baton.testing.tiny_model import tiny_model
from tests.plugins.parallel_common import check_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per pipeline stage)"
    ),
]


def test_pp2_nccl_matches_uniproc(tokenizer):
    check_parity(
        tiny_model("llama"), tokenizer, executor="pipeline", pipeline_parallel_size=2, device="cuda"
    )
