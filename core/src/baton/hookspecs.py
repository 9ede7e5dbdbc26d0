"""Deprecated: moved to ``baton.plugins.hookspecs`` (``hookimpl``: ``from baton import hookimpl``).

Each name still works here and warns (docs/stability.md, "Changes").
"""

from baton.plugins.moved import forward

__getattr__ = forward("baton.hookspecs", "baton.plugins.hookspecs")
