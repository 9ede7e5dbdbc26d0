"""Meta-tests: the plugin docs and tests keep up with the hookspecs.

- every hookspec has a section in docs/hooks.md headed by its exact signature, and a test named
  ``test_hook_<name>`` somewhere under tests/;
- every example in docs/hooks.md runs: registered as a plugin, it provides a name of its kind
  whose factory builds an object the kernel can use;
- docs/writing-a-plugin.md, followed literally (its files extracted from the page), gives a
  package that installs, shows in ``baton plugins``, is selected in baton.toml, serves requests
  and passes the conformance suite.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from pydantic import BaseModel

from baton import interfaces
from baton.config import BatonConfig
from baton.kv_transfer.connector import KVConnector
from baton.plugins import hookspecs
from baton.plugins.registry import KINDS, Plugins

ROOT = Path(__file__).resolve().parents[2]
HOOKS_MD = ROOT / "docs" / "hooks.md"
TUTORIAL_MD = ROOT / "docs" / "writing-a-plugin.md"
FENCE = re.compile(r"^```(\w+)(?:[ \t]+file=(\S+))?[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def hookspec_signatures() -> dict[str, str]:
    """name -> "name(arg, ...)" for every hookspec in baton.plugins.hookspecs."""
    out = {}
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if hasattr(fn, "baton_spec"):
            out[name] = f"{name}({', '.join(inspect.signature(fn).parameters)})"
    return out


def hook_sections() -> dict[str, str]:
    """hook name -> its section of docs/hooks.md (from its ``## `signature` `` heading to the next)."""
    text = HOOKS_MD.read_text()
    parts = re.split(r"^## `([a-z_]+)\((.*?)\)`[ \t]*$", text, flags=re.M)
    return {
        parts[i]: f"{parts[i]}({parts[i + 1]})\n{parts[i + 2]}" for i in range(1, len(parts), 3)
    }


def test_hookspecs_exist():
    sigs = hookspec_signatures()
    assert set(sigs) == set(KINDS), "hookspecs.py and registry.KINDS disagree"
    assert all(s == f"{n}(register)" for n, s in sigs.items())


@pytest.mark.parametrize("name", sorted(hookspec_signatures()))
def test_hookspec_is_documented_with_its_exact_signature(name):
    signature = hookspec_signatures()[name]
    sections = hook_sections()
    assert name in sections, f"docs/hooks.md has no section '## `{signature}`'"
    assert sections[name].startswith(signature + "\n"), (
        f"docs/hooks.md documents {sections[name].splitlines()[0]!r}; the hookspec is {signature!r}"
    )
    assert "```python" in sections[name], f"the {name} section has no example"


def _test_function_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
                "test_hook_"
            ):
                names.add(node.name)
    return names


@pytest.mark.parametrize("name", sorted(hookspec_signatures()))
def test_hookspec_has_a_test(name):
    assert f"test_hook_{name}" in _test_function_names(), (
        f"no test named test_hook_{name} under tests/"
    )


def _example(name: str) -> types.ModuleType:
    blocks = [code for lang, _, code in FENCE.findall(hook_sections()[name]) if lang == "python"]
    module = types.ModuleType(f"baton_docs_example_{name}")
    exec(compile(blocks[0], f"docs/hooks.md:{name}", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("name", sorted(hookspec_signatures()))
def test_hooks_md_example_runs(name):
    plugins = Plugins()
    plugins.load_entry_points({})
    plugins.register(_example(name), f"docs-{name}", "docs-example", "0")
    kind = KINDS[name]
    entries = [e for e in plugins.registry.of_kind(kind) if e.distribution == "docs-example"]
    assert len(entries) == 1, f"the {name} example registered {len(entries)} {kind} names"
    entry = entries[0]
    config = BatonConfig.load()
    if kind in ("command", "bench"):
        handler = entry.create(argparse.ArgumentParser())
        assert callable(handler)
        return
    if kind == "config_section":  # a settings model: its defaults validate
        assert isinstance(entry.create(), BaseModel)
        return
    args = {"structured_output": (None, None, 32000), "stat_logger": (None, 0)}.get(kind, (None,))
    product = entry.create(config, *args)
    protocol = {
        "scheduler_policy": interfaces.SchedulerPolicy,
        "executor": interfaces.Executor,
        "transport": interfaces.Transport,
        "speculator": interfaces.Speculator,
        "router": interfaces.Router,
        "engine_launcher": interfaces.EngineLauncher,
        "kv_connector": KVConnector,
    }.get(kind)
    if protocol is not None:
        assert isinstance(product, protocol)
    if kind == "structured_output":
        from baton.sampling_params import StructuredOutputSpec

        matcher = product.matcher(product.compile(StructuredOutputSpec(choice=["7", "40"])))
        bitmask = product.allocate_bitmask(1)
        matcher.fill_bitmask(bitmask, 0)
        assert int(bitmask[0, 0]) == 1 << 7 and int(bitmask[0, 1]) == 1 << 8
        assert matcher.accept_tokens([40]) and matcher.is_terminated()
    if kind == "stat_logger":
        product.record(None, None)
    if kind == "speculator":
        from baton.request import Request
        from baton.sampling_params import SamplingParams

        request = Request("r", [5, 9, 9], SamplingParams())
        assert list(product.propose(request, 3)) == [9, 9, 9]


def test_every_extension_point_has_a_conformance_suite():
    import baton.testing.conformance as conformance

    for suite in (
        "SchedulerPolicyConformance",
        "ExecutorConformance",
        "TransportConformance",
        "StructuredOutputConformance",
        "SpeculatorConformance",
        "KVConnectorConformance",
    ):
        cls = getattr(conformance, suite)
        assert inspect.isclass(cls) and any(n.startswith("test_") for n in dir(cls)), suite


# --------------------------------------------------------------------------- the tutorial


def tutorial_files() -> dict[str, str]:
    return {name: code for _, name, code in FENCE.findall(TUTORIAL_MD.read_text()) if name}


def test_tutorial_files_are_complete():
    files = tutorial_files()
    assert set(files) == {"pyproject.toml", "baton_turns.py", "test_turns.py", "baton.toml"}
    assert '[project.entry-points.baton]\nturns = "baton_turns"' in files["pyproject.toml"]


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_writing_a_plugin_followed_literally(tmp_path):
    from baton.engine.core import EngineCore
    from baton.protocol import EngineCoreRequest, ModelInfo
    from baton.sampling_params import SamplingParams
    from baton.testing import FakeExecutor

    pkg = tmp_path / "baton-turns"
    pkg.mkdir()
    for name, text in tutorial_files().items():
        (pkg / name).write_text(text)
    done = _pip("install", "--no-deps", "--no-build-isolation", "-q", str(pkg))
    assert done.returncode == 0, done.stderr
    try:
        # `baton plugins` (a fresh process, as a user runs it) lists it
        listed = subprocess.run(
            [sys.executable, "-m", "baton.cli.main", "plugins", "--json"],
            capture_output=True,
            text=True,
            check=True,
            cwd=pkg,
            timeout=120,
        )
        rows = {(r["kind"], r["name"]): r for r in json.loads(listed.stdout)["plugins"]}
        assert rows[("scheduler_policy", "turns")]["distribution"] == "baton-turns"
        assert rows[("scheduler_policy", "turns")]["version"] == "0.1.0"

        # selected in baton.toml, it serves requests (the engine core with the fake executor)
        importlib.invalidate_caches()
        plugins = Plugins()
        plugins.load_entry_points({})
        config = BatonConfig.load(pkg / "baton.toml", max_model_len=512)
        info = ModelInfo(
            path="fake", architecture="Fake", vocab_size=32000, max_model_len=512, eos_token_ids=[0]
        )
        core = EngineCore(config, registry=plugins.registry, executor=FakeExecutor(), info=info)
        assert type(core.scheduler.policy).__name__ == "TurnsPolicy"
        assert core.scheduler.policy.default_user == "guest"
        users = ["alice"] * 5 + ["bob"] * 2 + [None]
        for i, user in enumerate(users):
            core.add_request(
                EngineCoreRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=[3 + i] * 20,
                    eos_token_id=0,
                    user=user,
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=5),
                )
            )
        lengths: dict[str, int] = {}
        for step in range(200):
            if not core.has_work():
                break
            outs, _ = core.step_fn()
            if step == 0:  # max_num_seqs = 4 from baton.toml; users take turns
                assert [r.user for r in core.scheduler.running] == ["alice", "bob", None, "alice"]
            for o in outs.outputs if outs else ():
                lengths[o.request_id] = lengths.get(o.request_id, 0) + len(o.new_token_ids)
        assert lengths == {f"r{i}": 5 for i in range(8)}
        core.shutdown()

        # the page's Python example, with a tiny random model in place of the default one
        if importlib.util.find_spec("baton.executor.uniproc") is not None:
            from baton.testing.tiny_model import tiny_model

            snippet = [
                c
                for lang, name, c in FENCE.findall(TUTORIAL_MD.read_text())
                if lang == "python" and not name
            ]
            (pkg / "example.py").write_text(
                snippet[0] + "\nprint([len(o.outputs[0].token_ids) for o in outs])\n"
            )
            env = {
                **os.environ,
                "BATON_MODEL__NAME": str(tiny_model("llama")),
                "BATON_EXECUTOR__DEVICE": "cpu",
            }
            ran = subprocess.run(
                [sys.executable, "example.py"],
                capture_output=True,
                text=True,
                cwd=pkg,
                env=env,
                timeout=300,
            )
            assert ran.returncode == 0, ran.stderr[-3000:]
            lengths = json.loads(ran.stdout.strip().splitlines()[-1])
            assert len(lengths) == 2 and all(1 <= n <= 16 for n in lengths)

        # the page's conformance test, run as its author would
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
        tested = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_turns.py"],
            capture_output=True,
            text=True,
            cwd=pkg,
            env=env,
            timeout=300,
        )
        assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-2000:]
        assert " passed" in tested.stdout and "failed" not in tested.stdout
    finally:
        _pip("uninstall", "-y", "-q", "baton-turns")
        sys.modules.pop("baton_turns", None)
        importlib.invalidate_caches()
