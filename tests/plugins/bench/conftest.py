"""The OpenAI plugin's test server (a tiny model in a thread) for ``baton bench serve``'s tests:
the load runs against a real ``baton serve``, as a user's would."""

from __future__ import annotations

from tests.plugins.openai.conftest import engine_children, model_dir, server

__all__ = ["engine_children", "model_dir", "server"]
