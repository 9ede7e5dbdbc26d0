"""The README's table of baton-plugin-openai's parser kinds: one row per hookspec of
``baton_openai.hookspecs``, selected by the setting the hookspec names, with every parser the
plugin registers itself."""

from __future__ import annotations

import inspect
import re

from baton_openai import hookspecs
from baton_openai.parsing.registry import ParserRegistry
from tests.core.test_readme import README, code_names, table_rows

SELECTED_BY = re.compile(r"Selected by ``([\w.]+)``")


def parser_rows() -> dict[str, list[str]]:
    """The parser-kinds table by hook: its second cell's code name -> the row's cells."""
    return {next(iter(code_names(cells[1]))): cells for cells in table_rows(README, "parser-kinds")}


def hookspec_functions() -> dict[str, object]:
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, f"{hookspecs.PROJECT}_spec")
    }


def test_one_row_per_parser_hook_selected_by_what_the_hook_says():
    rows = parser_rows()
    specs = hookspec_functions()
    assert set(rows) == set(specs)
    for hook, fn in specs.items():
        setting = SELECTED_BY.search(inspect.getdoc(fn) or "")
        assert setting, f"{hook}'s docstring no longer says what selects it"
        assert code_names(rows[hook][2]) == {setting.group(1)}, hook


def test_each_row_names_the_plugins_own_parsers():
    rows = parser_rows()
    registry = ParserRegistry.load(autoload=False)
    for kind in registry.entries:
        hook = f"register_{kind}_parsers"
        assert code_names(rows[hook][3]) == set(registry.names(kind)), kind
