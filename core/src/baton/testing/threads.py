"""Run torch's CPU ops on a chosen number of threads for a block of test code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` inside the block; the caller's count restored after it,
    also when the block raises (a test must not leave the rest of the session on n threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
