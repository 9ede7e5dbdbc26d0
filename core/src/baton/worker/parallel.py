"""Moved to ``baton.parallel.context`` (public); this path keeps working for old imports."""

from baton.parallel.context import (  # noqa: F401
    CommTimers,
    ParallelContext,
    get_parallel_context,
    set_parallel_context,
)
