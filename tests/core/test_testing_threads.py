"""baton.testing.threads: the thread count a test sets is the caller's again afterwards."""

from __future__ import annotations

import pytest
import torch

from baton.testing.threads import torch_threads


def test_torch_threads_sets_the_count_and_restores_it_when_the_block_raises():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="inside"), torch_threads(other):
        assert torch.get_num_threads() == other
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
