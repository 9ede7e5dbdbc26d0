"""Measurement is out of the product: baton-core's wheel holds no benchmark and registers none;
baton-bench's holds them and registers them through the ``baton`` entry points."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
#: What a build leaves in a distribution's folder (not part of the sources).
BUILD_LEFTOVERS = ("build", "dist", "*.egg-info", "__pycache__")


def build_wheel(dist: str, tmp_path: Path) -> zipfile.ZipFile:
    """A wheel of ``dist`` built from a copy (a build writes build/ beside the sources)."""
    src = tmp_path / "src" / dist
    shutil.copytree(ROOT / dist, src, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    out = tmp_path / "wheels"
    pip_wheel = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")
    subprocess.run(
        [*pip_wheel, "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def entry_points(wheel: zipfile.ZipFile) -> str:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    return wheel.read(name).decode()


@pytest.mark.slow
def test_baton_core_wheel_has_no_bench_package_and_registers_no_bench(tmp_path):
    wheel = build_wheel("core", tmp_path)
    names = wheel.namelist()
    assert any(n.startswith("baton/sched/cost_model.py") for n in names)  # what the scheduler needs
    assert not [n for n in names if n.startswith("baton/bench/")]
    assert "bench" not in entry_points(wheel)


@pytest.mark.slow
def test_baton_bench_wheel_holds_the_benches_and_registers_them(tmp_path):
    wheel = build_wheel("plugins/bench", tmp_path)
    names = set(wheel.namelist())
    modules = ("plugin", "common", "scheduler", "simulator", "serve", "calibrate", "peers")
    for module in (*modules, "multiturn", "multiturn_workload"):
        assert f"baton_bench/{module}.py" in names, module
    assert "bench = baton_bench.plugin" in entry_points(wheel)


def test_baton_bench_without_baton_bench_says_what_to_install():
    """Only baton-core's built-ins loaded: `baton bench` names the distribution to install,
    and the other commands' parser still builds."""
    env = {**os.environ, "BATON_DISABLE_PLUGIN_AUTOLOAD": "1"}
    baton = (sys.executable, "-m", "baton.cli.main")
    proc = subprocess.run([*baton, "bench"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "no benchmark is installed" in proc.stderr and "pip install baton-bench" in proc.stderr
    proc = subprocess.run([*baton, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "bench" in proc.stdout
