"""Moved to ``baton.parallel.hooks`` (public, in baton-core): this path re-exports it."""

from baton.parallel.hooks import TensorParallelHooks

__all__ = ["TensorParallelHooks"]
