"""baton-plugin-cuda-tp: the ``cuda-tp`` executor (tensor parallel over worker processes)."""

__version__ = "0.1.0"
