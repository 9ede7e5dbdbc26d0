"""baton-plugin-openai's own hooks: tool-call and reasoning parsers for ``baton serve``.

The same style as baton's (``baton.plugins.hookspecs``): registration hooks that receive
``register(name, factory)`` and return nothing, in a pluggy project of their own
(``baton_openai``), found through the ``baton_openai`` entry-point group::

    [project.entry-points.baton_openai]
    my-parsers = "my_package.parsers"     # a module with @hookimpl functions

``factory(tokenizer)`` builds the parser when the server starts; the server's
config chooses one by name (``server.tool_call_parser``, ``server.reasoning_parser``).
The protocols the products implement are in ``baton_openai.parsing.types``.
A hook must only register: no I/O, no heavy imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "baton_openai"
#: The entry-point group other distributions register their parser modules under.
ENTRY_POINT_GROUP = "baton_openai"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: ``register(name, factory)``; ``factory(tokenizer)`` returns the parser.
ParserRegister = Callable[[str, Callable[[Any], Any]], None]


@hookspec
def register_tool_parsers(register: ParserRegister) -> None:
    """Register tool-call parsers: ``register(name, factory)``, ``factory(tokenizer)`` returning a
    ``baton_openai.parsing.types.ToolParser``. Selected by ``server.tool_call_parser``."""


@hookspec
def register_reasoning_parsers(register: ParserRegister) -> None:
    """Register reasoning parsers: ``register(name, factory)``, ``factory(tokenizer)`` returning a
    ``baton_openai.parsing.types.ReasoningParser``. Selected by ``server.reasoning_parser``."""
