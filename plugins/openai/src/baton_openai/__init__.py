"""baton-plugin-openai: ``baton serve`` (an OpenAI-compatible server) and the ``prometheus`` stat logger."""

__version__ = "0.1.0"
