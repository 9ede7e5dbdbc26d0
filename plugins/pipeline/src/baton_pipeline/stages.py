"""Moved to ``baton.parallel.stages`` (public, in baton-core): this path re-exports it."""

from baton.parallel.stages import (  # noqa: F401
    NoEmbedding,
    NoHead,
    Skip,
    StageIO,
    cut_stage,
    layer_ranges,
)
