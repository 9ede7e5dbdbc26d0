"""docs/writing-a-plugin.md's example plugins, one per kind, built from the page's own text: each
module is installed as a plugin distribution (a module and its .dist-info on the path, here and
in the processes baton spawns), and the page's conformance test for it runs as its author would
run it (pytest in a fresh process), so the page cannot drift from what passes: the executors on
MultiprocExecutor ("timed") and on WorkerGroup ("group", section 9), the speculator ("bigram", 10), the router ("sticky-user", 11,
with its two-engine AsyncLLM script) and the engine launcher ("niced", 12). The field tables of
the docs (``<!-- fields: module.Struct -->``) list exactly their struct's fields, in order, and
the argument tables (``<!-- arguments: module.Callable -->``) their callable's parameters.

The executor on WorkerGroup ("group") is also checked through ``LLM`` against ``uniproc``: the
same greedy tokens, ``get_memory_usage`` answered alike, and a ``collective_rpc`` target that
raises fails that call only (``sleep`` / ``wake_up`` and steps go on).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from baton.errors import BatonError
from baton.interfaces import Executor
from baton.plugins.registry import reset_plugins
from baton.protocol import ModelInfo
from baton.testing.tiny_model import tiny_model
from tests.core.plugin_fixtures import make_dist
from tests.core.test_executor_example import greedy, tiny_llm

PAGE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md"


def page_block(name: str) -> str:
    """The page's one ```python example=<name> block."""
    pattern = rf"^```python example={re.escape(name)}\n(.*?)^```[ \t]*$"
    [code] = re.findall(pattern, PAGE.read_text(), re.S | re.M)
    return code


class PagePlugin:
    """A page's example installed as a distribution in ``site``: its module, its tests."""

    def __init__(self, site: Path, module: str, tests: str) -> None:
        self.site, self.module, self.tests = site, module, tests

    def run_tests(self, **env: str) -> str:
        """Run the page's test file with pytest in a fresh process (``env``: BATON_* settings);
        its output. Fails when a test failed or none ran."""
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
        run_env.update(env)
        run_env["PYTHONPATH"] = os.pathsep.join(
            [str(self.site), str(PAGE.parents[1]), os.environ.get("PYTHONPATH", "")]
        )
        ran = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", self.tests],
            capture_output=True,
            text=True,
            cwd=self.site,
            env=run_env,
            timeout=1200,
        )
        assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
        assert " passed" in ran.stdout and "failed" not in ran.stdout, ran.stdout[-2000:]
        return ran.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PagePlugin]]:
    """Every example of the page as an installed plugin, visible here and to spawned processes."""
    site = tmp_path_factory.mktemp("site")
    plugins = {}
    for dist, module, block, name in EXAMPLES:
        make_dist(site, dist, module, page_block(block), name)
        tests = f"test_{module}.py"
        (site / tests).write_text(page_block(f"{block}-test"))
        plugins[block] = PagePlugin(site, module, tests)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        mp.syspath_prepend(str(site))
        reset_plugins()
        yield plugins
        reset_plugins()
    for _, module, _, _ in EXAMPLES:
        sys.modules.pop(module, None)


#: (distribution, module, the page's block name, the registered name)
EXAMPLES = [
    ("baton-timed", "baton_timed", "timed", "timed"),
    ("baton-group", "baton_group", "group", "group"),
    ("baton-bigram", "baton_bigram", "bigram", "bigram"),
    ("baton-sticky", "baton_sticky", "sticky", "sticky-user"),
    ("baton-niced", "baton_niced", "niced", "niced"),
]

#: A tiny random model for the page's tests, through baton's settings variables.
TINY = {
    "BATON_MODEL__NAME": str(tiny_model("llama")),
    "BATON_EXECUTOR__NUM_THREADS": "1",
    "BATON_CACHE__KV_CACHE_MEMORY": "64MiB",
}

# ---------------------------------------------------------------- the executor on WorkerGroup


@pytest.mark.slow
def test_the_group_executor_passes_the_pages_conformance_test(installed):
    out = installed["group"].run_tests(**TINY)
    assert "skipped" not in out, out[-2000:]  # the failure injection and memory checks ran


def fails_on_purpose(worker) -> None:
    """A collective_rpc target that raises (importable in the worker: this module)."""
    raise ValueError("on purpose")


@pytest.mark.slow
def test_the_group_executor_serves_like_uniproc(installed):
    seen = {}
    for backend in ("uniproc", "group"):
        with tiny_llm(backend) as engine:
            tokens = greedy(engine, 8)
            (memory,) = engine.get_memory_usage()
            (info,) = engine.collective_rpc("get_model_info")
            executor = engine.engine.core.executor
            assert isinstance(executor, Executor)
            if backend == "group":
                assert executor.worker_pids() == [memory.pid] and memory.pid != os.getpid()
                with pytest.raises(BatonError, match="ValueError: worker 0: on purpose"):
                    executor.collective_rpc(fails_on_purpose)
                executor.check_health()
                engine.sleep(1)
                (asleep,) = engine.get_memory_usage()
                assert asleep.kv_cache_bytes == 0 and asleep.weights_bytes == memory.weights_bytes
                engine.wake_up()
                again = greedy(engine, 8)
                assert again == tokens
            seen[backend] = (tokens, memory, msgspec.convert(info, ModelInfo))
    (tokens, memory, info), (ref_tokens, ref_memory, ref_info) = seen["group"], seen["uniproc"]
    assert tokens == ref_tokens and info == ref_info
    assert (memory.rank, memory.kv_cache_bytes, memory.weights_bytes, memory.weights_device) == (
        ref_memory.rank,
        ref_memory.kv_cache_bytes,
        ref_memory.weights_bytes,
        ref_memory.weights_device,
    )
    assert memory.rss_bytes > 0


# ---------------------------------------------------------------- speculator, router, launcher


@pytest.mark.slow
@pytest.mark.parametrize("block", ["bigram", "sticky", "niced"])
def test_the_pages_plugin_passes_its_conformance_test(installed, block):
    out = installed[block].run_tests()
    assert "skipped" not in out, out[-2000:]


@pytest.mark.slow
def test_the_multiproc_executor_passes_the_pages_conformance_test(installed):
    """Section 9's first executor ("timed", on MultiprocExecutor); test_executor_example.py
    checks its tokens against uniproc's."""
    out = installed["timed"].run_tests(**TINY)
    assert "skipped" not in out, out[-2000:]


@pytest.mark.slow
def test_the_pages_two_engine_script_runs(installed):
    plugin = installed["sticky"]
    script = plugin.site / "two_engines.py"
    script.write_text(page_block("sticky-run"))
    env = {**os.environ, **TINY, "PYTHONPATH": os.environ["PYTHONPATH"]}
    ran = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip().splitlines()[-1] == "4 answers"


# ---------------------------------------------------------------- the docs' field tables

DOCS = PAGE.parent
FIELDS = re.compile(r"^<!-- fields: ([\w.]+) -->\n(.*?)^<!-- /fields -->", re.S | re.M)


def struct_fields(path: str) -> list[str]:
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if hasattr(cls, "__struct_fields__"):  # msgspec
        return list(cls.__struct_fields__)
    return list(cls.model_fields)  # pydantic


def table_fields(table: str) -> list[str]:
    """The first column's names of a markdown table (its header and rule skipped)."""
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    return [re.match(r"\| `(\w+)` \|", row).group(1) for row in rows]


def test_the_docs_field_tables_list_their_structs_fields():
    tables = [
        (doc.name, m) for doc in sorted(DOCS.glob("*.md")) for m in FIELDS.finditer(doc.read_text())
    ]
    assert {m.group(1) for _, m in tables} >= {
        "baton.routing.types.RouteRequest",
        "baton.routing.types.EngineLoad",
        "baton.executor.workers.MultiprocSettings",
        "baton.protocol.WorkerMemory",
        "baton.scheduling_info.SchedulingInfo",
    }
    for doc, m in tables:
        assert table_fields(m.group(2)) == struct_fields(m.group(1)), (doc, m.group(1))


def test_hooks_md_names_every_field_a_router_reads():
    """hooks.md's router section names each RouteRequest and EngineLoad field as the struct
    spells it (it once called ``request_id`` "id" and left ``lora_int_id`` out)."""
    hooks = (DOCS / "hooks.md").read_text()
    section = hooks.split("## `register_routers(register)`", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", section))
    for struct in ("baton.routing.types.RouteRequest", "baton.routing.types.EngineLoad"):
        missing = [f for f in struct_fields(struct) if f not in named]
        assert not missing, (struct, missing)


ARGUMENTS = re.compile(r"^<!-- arguments: ([\w.]+) -->\n(.*?)^<!-- /arguments -->", re.S | re.M)


def parameters(path: str) -> list[str]:
    """A callable's parameters as a table names them (``**overrides``), ``self``/``cls`` left out;
    ``path`` is a module's attribute, or an attribute of one (``module.Class.method``)."""
    target = pkgutil.resolve_name(path)
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [
        stars.get(p.kind, "") + p.name
        for p in inspect.signature(target).parameters.values()
        if p.name not in ("self", "cls")
    ]


def test_the_docs_argument_tables_list_their_callables_parameters():
    """What a third-party author once had to read source for (Request's constructor,
    AsyncLLM.create / generate) is a table that cannot drift from the signature."""
    tables = [
        (doc.name, m)
        for doc in sorted(DOCS.glob("*.md"))
        for m in ARGUMENTS.finditer(doc.read_text())
    ]
    assert {m.group(1) for _, m in tables} >= {
        "baton.request.Request",
        "baton.frontend.async_llm.AsyncLLM.create",
        "baton.frontend.async_llm.AsyncLLM.generate",
    }
    for doc, m in tables:
        rows = [line for line in m.group(2).splitlines() if line.startswith("|")][2:]
        documented = [re.match(r"\| `(\**\w+)` \|", row).group(1) for row in rows]
        assert documented == parameters(m.group(1)), (doc, m.group(1))
