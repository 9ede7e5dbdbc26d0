"""Run a test file's tests again in a process whose kernels are built for another instruction set."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from baton.kernels.cpu_features import cpu_features
from baton.kernels.loader import ISA_ENV

#: Why a test of the AVX2 build is skipped where avx2_build_beside() is False.
AVX2_BUILD_SKIP = "an AVX-512 host checks the AVX2 build here (an AVX2-only host runs it natively)"


def avx2_build_beside() -> bool:
    """Whether this host builds the AVX2 kernels as a second build beside its own: an x86-64 CPU
    with AVX2, FMA and F16C that has AVX-512 too (without it the native build is the AVX2 one)."""
    flags = cpu_features().flags
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c", "avx512f"} <= flags


def pytest_in_build(isa: str, path: str, select: str, timeout: float = 1200) -> str:
    """``pytest -q -m "not slow" path -k select`` in a subprocess with ``$BATON_KERNEL_ISA=isa``
    (its own kernel build: ``avx2`` checks an AVX2-only CPU's paths on an AVX-512 host); returns
    its output. Raises AssertionError, with the output's tail, unless it ran tests and all
    passed."""
    args = ["-q", "-p", "no:cacheprovider", "-m", "not slow", path, "-k", select]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        env={**os.environ, ISA_ENV: isa},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]
    return proc.stdout
