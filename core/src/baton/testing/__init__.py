"""baton.testing: fakes and conformance suites for plugin authors.

``FakeExecutor`` runs the scheduler with no model (deterministic tokens,
latency and failure injection, contract checks); ``register_fake_executor``
makes it selectable as executor ``fake`` in a plugin manager. It is never
registered unless asked for.
"""

from baton.testing.fake_executor import FakeExecutor, FakeExecutorSettings, register_fake_executor

__all__ = ["FakeExecutor", "FakeExecutorSettings", "register_fake_executor"]
