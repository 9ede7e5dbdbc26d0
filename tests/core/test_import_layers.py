"""The import rule of docs/architecture.md is checked, not hoped for: import-linter's contracts in
pyproject.toml hold on this tree, a planted upward import (inside a function body, where a lazy
import would once have hidden it) breaks them, and the imports left inside function bodies are
few and each says why."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "src" / "baton"
CONTRACTS = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
#: docs/architecture.md: at most this many `baton` imports inside function bodies in baton-core
MAX_IN_FUNCTION = 20


def lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the workspace's contracts, on the ``baton`` found first on the path."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(CONTRACTS)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_contracts_hold_on_this_tree():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 3 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "planted", "reported"),
    [
        # the scheduler does not know the engine that calls it
        (
            "sched/victims.py",
            "from baton.engine import core",
            "baton.sched.victims -> baton.engine.core",
        ),
        # the config is below the registry that reads it
        (
            "config/sections.py",
            "from baton.plugins import registry",
            "baton.config.sections -> baton.plugins.registry",
        ),
        # baton-core finds plugins through entry points, never by importing them
        ("kv/manager.py", "import baton_openai", "baton.kv.manager -> baton_openai"),
    ],
)
def test_a_planted_import_breaks_the_contracts(tmp_path, module, planted, reported):
    src = tmp_path / "src"
    shutil.copytree(CORE, src / "baton", ignore=shutil.ignore_patterns("__pycache__"))
    target = src / "baton" / module
    # inside a function body: the kind of import that used to dodge a cycle
    target.write_text(target.read_text() + f"\n\ndef _planted() -> None:\n    {planted}\n")
    done = lint_imports(tmp_path, pythonpath=src)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BROKEN" in done.stdout
    assert reported in done.stdout, done.stdout


def in_function_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source) of each ``baton`` import inside a function body in ``path``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if inside and isinstance(child, ast.ImportFrom):
                names = [child.module or ""] if not child.level else ["baton"]
            elif inside and isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            else:
                names = []
            if any(n.split(".")[0] == "baton" for n in names):
                found.append((child.lineno, ast.unparse(child)))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def test_few_imports_inside_functions_and_each_says_why():
    """Each one left is for an optional heavy dependency or the CLI's start-up, with a reason
    comment on its line or the line above; never the way round a cycle."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for lineno, source in in_function_imports(path):
            here, above = lines[lineno - 1], lines[lineno - 2].strip()
            has_reason = "#" in here or above.startswith("#")
            found.append((f"{path.relative_to(ROOT)}:{lineno}: {source}", has_reason))
    unexplained = [where for where, has_reason in found if not has_reason]
    assert not unexplained, (
        "say why (a comment) or move it to the top of the module:\n" + "\n".join(unexplained)
    )
    assert len(found) <= MAX_IN_FUNCTION, "\n".join(where for where, _ in found)
