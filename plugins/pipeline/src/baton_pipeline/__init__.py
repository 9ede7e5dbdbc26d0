"""baton-plugin-pipeline: the ``pipeline`` executor (pipeline parallel over worker processes, batch queue)."""

__version__ = "0.1.0"
