"""Public building blocks of parallel executors: a worker's place in the group, TP sharding.

``ParallelContext`` (``get_parallel_context()`` in a worker process of
``baton.executor.multiproc``) says where a worker sits in the tensor x pipeline
group and runs its timed collectives; ``baton.parallel.sharding`` splits a
loaded Hugging Face model across the tensor-parallel ranks of a stage.
"""

from baton.parallel.context import CommTimers, ParallelContext, get_parallel_context

__all__ = ["CommTimers", "ParallelContext", "get_parallel_context"]
