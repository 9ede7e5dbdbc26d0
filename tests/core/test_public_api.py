"""The public names are one list (baton.plugins.public_api.PUBLIC_NAMES): docs/stability.md prints it,
every listed name exists, and no plugin under plugins/ or contrib/ imports anything else from
baton, nor another plugin's package (parsed with ast, not imported)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import baton.plugins
from baton.plugins import registry
from baton.plugins.kinds import PLUGIN_KINDS
from baton.plugins.public_api import (
    PUBLIC_NAMES,
    SURFACE,
    is_public,
    markdown,
    missing_names,
)

ROOT = Path(__file__).resolve().parents[2]
STABILITY = ROOT / "docs" / "stability.md"
BLOCK = re.compile(
    r"<!-- public-names: python -m baton.plugins.public_api -->\n(.*?)\n<!-- /public-names -->",
    re.S,
)


def distributions() -> dict[Path, set[str]]:
    """Each plugin distribution's folder -> its own top-level packages (under src/)."""
    out = {}
    for pyproject in sorted(
        [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("contrib/*/pyproject.toml")]
    ):
        src = pyproject.parent / "src"
        out[pyproject.parent] = {
            p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()
        } | {p.stem for p in src.glob("*.py")}
    return out


def violations(path: Path, own: set[str], first_party: set[str]) -> list[str]:
    """``file:line: what`` for each import of a non-public baton name or another plugin's package."""
    bad = []
    where = path.relative_to(ROOT)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pairs = [(node.module, alias.name) for alias in node.names]
        else:
            continue  # relative imports stay in the plugin's own package
        for module, name in pairs:
            top = module.partition(".")[0]
            if top == "baton":
                if module == "baton" and name is None:
                    continue  # `import baton`: attribute use is not checked here
                if is_public(module, name) or f"{module}.{name}" in PUBLIC_NAMES:
                    continue
                shown = f"{module}.{name}" if name else module
                bad.append(f"{where}:{node.lineno}: {shown} is not public (docs/stability.md)")
            elif top in first_party and top not in own:
                bad.append(f"{where}:{node.lineno}: imports another plugin's package {module!r}")
    return bad


#: Distributions that may import baton's internals and other first-party plugins, and why.
INSIDERS = {
    # it measures the Scheduler, the EngineCore, the kernels and the first-party plugins from
    # the inside, and pins the baton-core version it measures
    ROOT / "plugins" / "bench": "baton-bench",
}


def test_plugins_import_only_public_names():
    dists = distributions()
    assert len(dists) >= 8, dists  # zmq, shm, cuda-tp, pipeline, xgrammar, openai, sjf, fair
    assert set(INSIDERS) <= set(dists), INSIDERS
    first_party = set().union(*dists.values())
    bad = []
    for folder, own in dists.items():
        if folder in INSIDERS:
            continue
        for path in sorted(folder.rglob("*.py")):
            if "egg-info" not in str(path):
                bad += violations(path, own, first_party)
    assert not bad, "\n".join(bad)


def test_the_check_catches_internal_and_cross_plugin_imports(tmp_path):
    code = (
        "from baton.worker.model_runner import ModelRunner\n"
        "import baton.executor.uniproc\n"
        "from baton.runner import StockRunner\n"
        "from baton.protocol import SchedulerOutput\n"
        "from baton_cuda_tp.runner import TensorParallelHooks\n"
        "from baton_pipeline.stages import cut_stage\n"
        "from . import sibling\n"
    )
    path = ROOT / "plugins" / "pipeline" / "src" / "_probe_public_api.py"
    path.write_text(code)
    try:
        bad = violations(path, {"baton_pipeline"}, {"baton_pipeline", "baton_cuda_tp"})
    finally:
        path.unlink()
    assert [b.split(": ", 1)[1] for b in bad] == [
        "baton.worker.model_runner.ModelRunner is not public (docs/stability.md)",
        "baton.executor.uniproc is not public (docs/stability.md)",
        "imports another plugin's package 'baton_cuda_tp.runner'",
    ]


def test_every_listed_name_exists():
    assert missing_names() == []


def test_stability_md_prints_the_list():
    found = BLOCK.search(STABILITY.read_text())
    assert found, "docs/stability.md lost its <!-- public-names --> block"
    assert found.group(1) == markdown(), "regenerate it: python -m baton.plugins.public_api"


@pytest.mark.parametrize(
    "module,name,public",
    [
        ("baton.protocol", "ModelCapabilities", True),
        ("baton.protocol", "_STRUCT", False),
        ("baton.interfaces", "ModelRunner", True),
        ("baton.worker.worker", "Worker", False),
        ("baton.executor.multiproc", None, False),
        ("baton.errors", None, True),
    ],
)
def test_is_public(module, name, public):
    assert is_public(module, name) is public


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("baton.hookspecs", "baton.plugins.hookspecs", "hookimpl"),
        ("baton.hookspecs", "baton.plugins.hookspecs", "PLUGIN_API_VERSION"),
        ("baton.plugin_kinds", "baton.plugins.kinds", "PLUGIN_KINDS"),
    ],
)
def test_a_moved_public_module_still_works_and_warns(old: str, new: str, name: str) -> None:
    """docs/stability.md's deprecation rule: the old path of a moved public name keeps working
    for a release and warns, naming the new path."""
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(new)}\.{name}"):
        value = getattr(old_module, name)
    assert value is getattr(new_module, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        old_module.nope  # noqa: B018 - the attribute access is the test


def test_the_plugins_package_serves_its_public_names() -> None:
    for name in PUBLIC_NAMES["baton.plugins"]:
        assert getattr(baton.plugins, name) is getattr(registry, name)


def test_every_plugin_kind_has_its_group_of_names() -> None:
    """The list is grouped by who needs it: each kind an author can write has its group, and
    each kind's product protocol is in it."""
    for kind in PLUGIN_KINDS.values():
        assert kind.name in SURFACE, f"no public names for {kind.name!r} plugins"
        if kind.product is not None:
            assert kind.product.__name__ in SURFACE[kind.name]["baton.interfaces"], kind.name


@pytest.mark.parametrize(
    ("module", "name", "internal", "instead"),
    [
        ("baton.cli.main", "ENGINE_FLAGS", "_ENGINE_FLAGS", "engine_argv"),
        ("baton.executor.rank", "check_rpc_method", "_check_rpc_method", "StepCodec.encode_rpc"),
        ("baton.executor.rank", "check_plugin_set", "_check_plugin_set", "Rank"),
        (
            "baton.frontend.input_processor",
            "InputProcessor",
            "baton.frontend.prompts:InputProcessor",
            "AsyncLLM's tokenize",
        ),
    ],
)
def test_a_retired_public_name_still_works_and_warns(
    module: str, name: str, internal: str, instead: str
) -> None:
    """docs/stability.md's deprecation rule for a name that left the public list in issue 31:
    it works until 0.3.0 and warns, naming what to use instead."""
    assert not is_public(module, name)
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(module)}\.{name} is no longer"):
        value = getattr(mod, name)
    home, _, internal = internal.rpartition(":")  # "module:name": it lives elsewhere now
    assert value is getattr(importlib.import_module(home) if home else mod, internal)
    with pytest.warns(DeprecationWarning, match=re.escape(instead)):
        exec(f"from {module} import {name}", {})
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mod.nope  # noqa: B018 - the attribute access is the test
