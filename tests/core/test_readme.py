"""The plugin-kind tables of README.md and docs/architecture.md name every plugin kind of the
kind registry, how each is selected, and (the README's) every plugin `baton plugins --json`
reports, so they cannot drift again (issue 31: the README once lacked `router`,
`engine_launcher` and `bench`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

# The kind registry: the one line to change when it moves.
from baton.plugins.kinds import PLUGIN_KINDS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CODE = re.compile(r"`([^`]+)`")


def table_rows(page: Path, marker: str) -> list[list[str]]:
    """The cells of each body row of the table between ``<!-- marker ... -->`` and
    ``<!-- /marker -->`` in ``page`` (its header and rule skipped)."""
    found = re.search(
        rf"^<!-- {marker}\b.*?-->\n(.*?)^<!-- /{marker} -->", page.read_text(), re.S | re.M
    )
    assert found, f"{page.name} lost its <!-- {marker} --> table markers"
    lines = [line for line in found.group(1).splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def code_names(cell: str) -> set[str]:
    """The names a cell writes as code (`fcfs`), whatever the prose around them."""
    return set(CODE.findall(cell))


def kind_rows(page: Path) -> dict[str, list[str]]:
    """A page's plugin-kinds table by kind: its first cell's code name -> the row's cells."""
    rows: dict[str, list[str]] = {}
    for cells in table_rows(page, "plugin-kinds"):
        kind = CODE.search(cells[0])
        assert kind, f"{page.name}: a plugin-kinds row without a `kind`: {cells}"
        assert kind.group(1) not in rows, f"{page.name} names kind {kind.group(1)!r} twice"
        rows[kind.group(1)] = cells
    return rows


def plugin_names(cells: list[str]) -> set[str]:
    """The plugin names of a README row: its built-in and other distributions' columns."""
    return code_names(cells[2]) | code_names(cells[3])


def assert_selected_by(page: Path, rows: dict[str, list[str]], column: int) -> None:
    for kind in PLUGIN_KINDS.values():
        selected_by = code_names(rows[kind.name][column])
        if kind.section is not None:
            assert selected_by == {kind.selector_path()}, (page.name, kind.name, selected_by)
        elif kind.name == "config_section":  # the config's own table: there when installed
            assert selected_by == {"[<name>]"}, (page.name, kind.name, selected_by)
        else:  # commands and benchmarks: the `baton` command line picks them
            assert selected_by and all(s.startswith("baton ") for s in selected_by), kind.name


def test_the_readme_has_one_row_per_plugin_kind_and_says_how_it_is_selected():
    rows = kind_rows(README)
    assert set(rows) == set(PLUGIN_KINDS)
    assert_selected_by(README, rows, column=1)


def test_architecture_md_names_each_kinds_hook_selector_and_product():
    rows = kind_rows(ARCHITECTURE)
    assert set(rows) == set(PLUGIN_KINDS)
    assert_selected_by(ARCHITECTURE, rows, column=2)
    for kind in PLUGIN_KINDS.values():
        assert code_names(rows[kind.name][1]) == {kind.hook}, kind.name
        if kind.product is not None:
            assert kind.product.__name__ in code_names(rows[kind.name][3]), kind.name


def test_each_readme_row_names_its_kinds_known_plugins_and_their_distributions():
    rows = kind_rows(README)
    for kind in PLUGIN_KINDS.values():
        cells = rows[kind.name]
        missing = (set(kind.builtin) | set(kind.distributions)) - plugin_names(cells)
        assert not missing, (kind.name, missing)
        for name, dist in kind.distributions.items():
            assert dist in cells[3], (kind.name, name, dist)


def test_the_readme_names_every_plugin_baton_plugins_reports():
    """Every (kind, name) of `baton plugins --json` (a fresh process, as a user runs it, with
    every distribution this checkout installs), and the distribution of those outside
    baton-core."""
    cli = [sys.executable, "-m", "baton.cli.main", "plugins", "--json"]
    report = json.loads(subprocess.check_output(cli, text=True, timeout=120))
    assert not report["failed"], report["failed"]
    rows = kind_rows(README)
    for plugin in report["plugins"]:
        kind, name, dist = plugin["kind"], plugin["name"], plugin["distribution"]
        assert kind in rows, f"README's plugin table has no row for kind {kind!r}"
        assert name in plugin_names(rows[kind]), f"README's {kind} row lacks {name!r} ({dist})"
        if dist != "baton-core":
            assert dist in rows[kind][3], f"README's {kind} row lacks {dist} (for {name!r})"


def test_the_readme_lists_the_config_command():
    assert "config" in plugin_names(kind_rows(README)["command"])
    assert "baton config check" in README.read_text()
