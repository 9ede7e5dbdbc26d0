"""Tensor parallel on CUDA with NCCL: one GPU per rank. Skipped without two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from baton.testing.tiny_model import tiny_model
from tests.plugins.parallel_common import check_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per tensor-parallel rank)"
    ),
]


def test_tp2_nccl_matches_uniproc(tokenizer):
    check_parity(
        tiny_model("llama"), tokenizer, executor="cuda-tp", tensor_parallel_size=2, device="cuda"
    )
