"""Moved to ``baton.parallel.hooks`` (public, in baton-core): this path re-exports it.

The stage's runner hooks: the stock runner on this stage's layers, hidden states in
and out (``baton.parallel.hooks.PipelineStageHooks``).
"""

from baton.parallel.hooks import PipelineStageHooks

__all__ = ["PipelineStageHooks"]
