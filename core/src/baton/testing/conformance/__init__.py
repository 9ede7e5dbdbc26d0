"""baton.testing.conformance: one suite per extension point, for a plugin's own tests to subclass.

- ``SchedulerPolicyConformance`` (``.scheduler_policy``): set ``name`` or override ``make_policy(config)``.
- ``ExecutorConformance`` (``.executor``): provide an ``executor`` fixture.
- ``TransportConformance`` (``.transport``): provide a ``transport`` fixture.
- ``StructuredOutputConformance`` (``.structured_output``): see that module.
- ``SpeculatorConformance`` (``.speculator``): set ``name`` or override ``make_speculator(config)``.
- ``RouterConformance`` (``.router``): set ``name`` or override ``make_router(config)``.
- ``EngineLauncherConformance`` (``.engine_launcher``): set ``name`` or override
  ``make_launcher(config)``.
- ``KVConnectorConformance`` (``.kv_connector``): set ``name`` (and ``settings``).

Each suite is a plain class of ``test_*`` methods: ``class TestMine(SchedulerPolicyConformance):
name = "mine"`` collects them all in your test module. Names are imported lazily, so importing
one suite never pulls in another's dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUITES = {
    "SchedulerPolicyConformance": "baton.testing.conformance.scheduler_policy",
    "ExecutorConformance": "baton.testing.conformance.executor",
    "TransportConformance": "baton.testing.conformance.transport",
    "StructuredOutputConformance": "baton.testing.conformance.structured_output",
    "SpeculatorConformance": "baton.testing.conformance.speculator",
    "RouterConformance": "baton.testing.conformance.router",
    "EngineLauncherConformance": "baton.testing.conformance.engine_launcher",
    "KVConnectorConformance": "baton.testing.conformance.kv_connector",
}

__all__ = sorted(_SUITES)


def __getattr__(name: str) -> Any:
    module = _SUITES.get(name)
    if module is None:
        raise AttributeError(f"module 'baton.testing.conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
