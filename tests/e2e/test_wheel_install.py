"""Installs as users install: a wheel of every distribution builds; those of baton-core,
baton-plugin-zmq and baton-plugin-cuda-tp install (not editable) in a fresh virtual environment, then a config file selecting zmq and cuda-tp,
and `baton generate`. Slow: it installs torch into the new environment (~1 min)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from baton.testing.tiny_model import tiny_model

ROOT = Path(__file__).resolve().parents[2]
#: Every distribution of the repository: each must build a wheel.
DISTS = sorted(
    str(p.parent.relative_to(ROOT))
    for p in [ROOT / "core" / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml"),
              *ROOT.glob("contrib/*/pyproject.toml")]
)  # fmt: skip
#: What a build leaves in a distribution's folder.
BUILD_LEFTOVERS = ("build", "dist", "*.egg-info", "__pycache__")
#: What a user installs (README): the kernel and two plugins.
INSTALLED = ("baton_core", "baton_plugin_zmq", "baton_plugin_cuda_tp")


def run(*args: str | Path, cwd: Path | None = None, timeout: float = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


@pytest.mark.slow
def test_wheels_install_in_a_fresh_venv_and_generate_with_zmq_and_cuda_tp(tmp_path):
    # built from copies: setuptools writes build/ beside the sources, and files left there by an
    # earlier build (even of a module since deleted) would go into the wheel
    src = tmp_path / "src"
    for d in DISTS:
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", wheels, *(src / d for d in DISTS))  # fmt: skip
    built = {p.name.split("-")[0]: p for p in wheels.glob("*.whl")}
    assert len(built) == len(DISTS), (sorted(built), DISTS)

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    # the torch build this checkout tests with (make setup's TORCH), then the wheels; no .pyc
    # byte-compiling at install: torch and transformers hold thousands of modules
    pip = (py, "-m", "pip", "install", "-q", "--no-compile")
    run(*pip, f"torch=={importlib.metadata.version('torch')}")
    run(*pip, *(built[name] for name in INSTALLED))

    where = run(py, "-c", "import baton, baton_zmq, baton_cuda_tp; print(baton.__file__)")
    assert str(venv) in where, f"baton imported from {where.strip()}, not the new environment"
    plugins = json.loads(run(venv / "bin" / "baton", "plugins", "--json"))
    entries = plugins if isinstance(plugins, list) else plugins["plugins"]
    provided = {(e["kind"], e["name"]): e["distribution"] for e in entries}
    assert provided[("transport", "zmq")] == "baton-plugin-zmq"
    assert provided[("executor", "cuda-tp")] == "baton-plugin-cuda-tp"

    config = tmp_path / "baton.toml"
    config.write_text(
        f'[model]\nname = "{tiny_model("llama")}"\nmax_model_len = 256\n'
        '[transport]\nname = "zmq"\n'
        '[executor]\nbackend = "cuda-tp"\ntensor_parallel_size = 2\ndevice = "cpu"\n'
        "num_threads = 1\n"
    )
    out = run(
        venv / "bin" / "baton", "generate", "Hello there", "--config", config,
        "--max-tokens", "5", cwd=tmp_path,
    )  # fmt: skip
    assert out.strip(), "baton generate printed nothing"
