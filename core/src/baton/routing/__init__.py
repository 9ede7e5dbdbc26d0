"""Data-parallel routing: which engine core serves a request (``executor.data_parallel_size``).

The frontend's client asks the configured router (``routing.router``, a plugin kind:
``register_routers``) for an engine per request, passing each engine's load; built in:
``least-loaded``, ``round-robin`` (``baton.routing.routers``) and ``prefix-aware``
(``baton.routing.prefix_aware``).
"""

from baton.routing.types import EngineLoad, RouteRequest

__all__ = ["EngineLoad", "RouteRequest"]
