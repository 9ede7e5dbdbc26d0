"""Deprecated: moved to ``baton.plugins.kinds``.

Each name still works here and warns (docs/stability.md, "Changes").
"""

from baton.plugins.moved import forward

__getattr__ = forward("baton.plugin_kinds", "baton.plugins.kinds")
