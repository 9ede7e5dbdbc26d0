"""Build and load baton's CPU kernels (the ``*.cpp`` next to this file) as torch operators.

The sources ship with baton-core and are compiled once per machine with the
system's C++ compiler (``$CXX``, else ``c++``) against the installed torch, for
this CPU (``-march=native``). The library lands in the kernel cache
(``$BATON_KERNEL_DIR``, else ``<user cache>/baton/kernels``) under a key made of
everything that shapes it: sources, torch version, compiler, flags and CPU
features, so another machine or torch never loads a stale build. Concurrent
builders (tensor-parallel workers, test processes) serialise on a file lock
and publish the library by an atomic rename.

``load()`` never raises for a missing compiler or a failed build: it logs a
warning naming the cause and returns False, and attention and linears run on
torch ops.
Registered operators (documented in the sources): ``torch.ops.baton.paged_decode``
and ``paged_write`` (paged_attention.cpp), ``linear_small`` (small_gemm.cpp),
``linear_q`` and ``dequantize_q`` (quant_gemm.cpp), ``decode_layers`` (decode_stack.cpp: a
decode step's whole layer stack, calling the others).

``$BATON_KERNEL_ISA`` picks the instruction set the kernels are compiled for (part
of the cache key): ``native`` (default: everything this CPU has), ``avx2`` (this
CPU's features without AVX-512, so an AVX-512 host runs and tests the AVX2 code
paths; x86-64 only) or ``generic`` (x86-64-v2 on x86, the compiler's baseline
elsewhere: the sources' portable paths, no AVX).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from baton.errors import BatonError
from baton.kernels.os_grant import amx_grant
from baton.kernels.packed_stream import packed_stream_choice

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
#: Headers the sources include (part of a build's key, not compiled on their own).
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
LIBRARY = "baton_cpu_kernels.so"
KERNEL_DIR_ENV = "BATON_KERNEL_DIR"
ISA_ENV = "BATON_KERNEL_ISA"
#: The compiler flags besides the instruction set's (cxx_flags puts that after -O3).
CXX_FLAGS = ("-O3", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w")
#: $BATON_KERNEL_ISA -> the -m flags it compiles with (on x86-64; see isa_flags).
ISA_FLAGS = {
    "native": ("-march=native",),
    "avx2": ("-march=native", "-mno-avx512f"),
    "generic": ("-march=x86-64-v2",),
}
#: Added where the CPU advertises AMX and the OS refuses it (os_grant): no tile code is compiled.
NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")

_loaded: bool | None = None


class KernelBuildError(BatonError):
    """The CPU kernels could not be compiled or loaded."""


def kernel_dir() -> Path:
    """Where built kernels are kept: $BATON_KERNEL_DIR, else the user cache."""
    env = os.environ.get(KERNEL_DIR_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("baton")) / "kernels"


def compiler() -> str | None:
    """The path of the C++ compiler builds use ($CXX, else c++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _compiler() -> str:
    path = compiler()
    if path is None:
        raise KernelBuildError(
            f"no C++ compiler {os.environ.get('CXX', 'c++')!r} on PATH: install g++ "
            "(apt install g++) or set CXX"
        )
    return path


def isa_flags() -> tuple[str, ...]:
    """The instruction-set flags $BATON_KERNEL_ISA asks for (native, avx2 or generic)."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise KernelBuildError(
            f"{ISA_ENV}={isa!r} is not an instruction set the kernels compile for: "
            f"use one of {', '.join(ISA_FLAGS)} (or unset it for native)"
        )
    if platform.machine().lower() not in ("x86_64", "amd64"):
        if isa == "avx2":
            raise KernelBuildError(
                f"{ISA_ENV}=avx2 needs an x86-64 CPU, this one is {platform.machine()}: "
                "use native or generic"
            )
        if isa == "generic":
            return ()
    if isa == "avx2" and "avx512f" not in cpu_flags():
        # without AVX-512 the native build is the AVX2 one: the same flags, so the same cached build
        isa = "native"
    grant = amx_grant(cpu_flags())
    if isa == "generic" or not grant.advertised or grant.granted:
        return ISA_FLAGS[isa]
    return (*ISA_FLAGS[isa], *NO_AMX_FLAGS)


def cxx_flags() -> tuple[str, ...]:
    """Every flag a build compiles with: -O3, the instruction set's, then the rest."""
    return (CXX_FLAGS[0], *isa_flags(), *CXX_FLAGS[1:])


def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as a set (empty where /proc/cpuinfo has none)."""
    line = _cpu_features()
    return frozenset(line.partition(":")[2].split()) if line.startswith("flags") else frozenset()


def _compile_flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [*cxx_flags(), abi, *(f"-I{p}" for p in cpp_extension.include_paths())]


def _object_command(cxx: str, source: Path, out: Path) -> list[str]:
    """Compile one source to an object file (the sources compile in parallel, then link)."""
    return [cxx, *_compile_flags(), "-c", str(source), "-o", str(out)]


def _command(cxx: str, inputs: tuple[Path, ...], out: Path) -> list[str]:
    """Link object files (or compile and link sources) into the shared library ``out``."""
    from torch.utils import cpp_extension

    lib_dirs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return [
        cxx,
        *_compile_flags(),
        *map(str, inputs),
        "-o",
        str(out),
        *lib_dirs,
        "-lc10",
        "-ltorch_cpu",
    ]


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise KernelBuildError(
            f"compiling {what} failed (exit {proc.returncode}): {tail}\ncommand: {' '.join(cmd)}"
        )


def _compile(cxx: str, sources: tuple[Path, ...], out: Path, scratch: Path) -> None:
    """Compile ``sources`` to objects in ``scratch``, one compiler per core, and link ``out``."""
    from concurrent.futures import ThreadPoolExecutor

    objects = tuple(scratch / f"{p.stem}.o" for p in sources)
    jobs = max(1, min(len(sources), os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        # list(): re-raise the first failure
        list(
            pool.map(
                lambda so: _run(_object_command(cxx, so[0], so[1]), so[0].name),
                zip(sources, objects, strict=True),
            )
        )
    _run(_command(cxx, objects, out), ", ".join(p.name for p in sources))


def library_path(sources: tuple[Path, ...] = SOURCES, directory: Path | None = None) -> Path:
    """Where the library compiled from ``sources`` for this machine lives (it may not exist yet)."""
    if not sources:
        raise KernelBuildError(
            f"no kernel sources next to {__file__}: a broken install of baton-core"
        )
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(p.read_text() for p in (*sources, *HEADERS)),
                torch.__version__,
                version,
                " ".join(cxx_flags()),
                platform.machine(),
                _cpu_features(),
            ]
        ).encode()
    ).hexdigest()[:16]
    return (directory or kernel_dir()) / key / LIBRARY


def build(sources: tuple[Path, ...] = SOURCES, directory: Path | None = None) -> Path:
    """The path of the library compiled from ``sources``, compiling it if no build matches."""
    lib = library_path(sources, directory)
    if lib.exists():
        return lib
    cxx = _compiler()
    folder = lib.parent
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if lib.exists():
            return lib
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
        os.close(fd)
        log.info("compiling baton's CPU kernels (once per machine and torch version) ...")
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                _compile(cxx, sources, Path(tmp), Path(scratch))
        except KernelBuildError:
            Path(tmp).unlink(missing_ok=True)
            raise
        os.replace(tmp, lib)
        log.info("built %s in %.1f s", lib, time.perf_counter() - t0)
    return lib


def load(build_missing: bool = True) -> bool:
    """Build (if needed) and load the kernels once per process; False, with a warning, if they
    cannot be. ``build_missing=False``: False (no warning) when this machine has no build yet."""
    global _loaded
    if _loaded is None and not build_missing:
        try:
            if not library_path().exists():
                return False
        except KernelBuildError:
            return False
    if _loaded is None:
        packed_stream_choice()  # a bad BATON_PACKED_STREAM is an error here, not a silent default
        try:
            torch.ops.load_library(str(build()))
            _loaded = True
        except (KernelBuildError, OSError, RuntimeError) as e:
            log.warning(
                "baton's C++ CPU kernels are unavailable, attention runs on torch ops (slower), "
                "as do the decode steps' linears: %s",
                e,
            )
            _loaded = False
    return _loaded
