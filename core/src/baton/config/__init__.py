"""baton's configuration: one pydantic-settings model, eleven sections.

Sources, strongest first: explicit arguments (``LLM(**overrides)``, CLI flags),
``BATON_<SECTION>__<FIELD>`` environment variables, a TOML or YAML file (given
with ``--config`` or ``BATON_CONFIG``), defaults. A plugin's own settings sit in
a sub-table named after it (``[transport.zmq]``) and are validated by the
settings model the plugin registered (see ``BatonConfig.plugin_settings``).

- ``sections``: one model per section (``ModelSection``, ...).
- ``baton_config``: ``BatonConfig`` (sources, checks across sections, plugin sub-tables).
- ``overrides``: the keyword forms ``load`` / ``replace`` accept.
- ``messages``: how a refused value is worded.

The public names (docs/stability.md) are importable from ``baton.config``.
"""

from baton.config.baton_config import BatonConfig
from baton.config.sections import (
    CacheSection,
    ExecutorSection,
    LoRASection,
    ModelSection,
    ObservabilitySection,
    RoutingSection,
    SchedulerSection,
    ServerSection,
    SpeculativeSection,
    StructuredOutputSection,
    TransportSection,
)

__all__ = [
    "BatonConfig",
    "CacheSection",
    "ExecutorSection",
    "LoRASection",
    "ModelSection",
    "ObservabilitySection",
    "RoutingSection",
    "SchedulerSection",
    "ServerSection",
    "SpeculativeSection",
    "StructuredOutputSection",
    "TransportSection",
]
