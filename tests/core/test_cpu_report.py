"""The CPU report (``baton env``), the OS's AMX grant and the kernel build's response to it."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from baton.kernels import loader, os_grant, report
from baton.kernels.cpu_features import features_from
from baton.kernels.exact_packing import PACKED_EXACT_ENV, packed_exact_choice
from baton.kernels.os_grant import Grant, probe_amx
from baton.kernels.packed_stream import PackedStream

AMX = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
X86 = loader.platform.machine() in ("x86_64", "AMD64")


def _refuse(number: int, code: int, arg: int) -> tuple[int, int]:
    assert (number, code, arg) == (
        os_grant.SYS_ARCH_PRCTL,
        os_grant.ARCH_REQ_XCOMP_PERM,
        os_grant.XFEATURE_XTILEDATA,
    )
    return -1, errno.EPERM


def _grant(number: int, code: int, arg: int) -> tuple[int, int]:
    return 0, 0


@pytest.mark.skipif(not X86 or os_grant.platform.system() != "Linux", reason="x86-64 Linux probe")
def test_amx_probe_refused_granted_and_absent(monkeypatch):
    monkeypatch.delenv(os_grant.NO_AMX_ENV, raising=False)
    refused = probe_amx(AMX, syscall=_refuse)
    assert (refused.advertised, refused.granted) == (True, False)
    assert "EPERM" in refused.reason and "ARCH_REQ_XCOMP_PERM" in refused.reason
    assert probe_amx(AMX, syscall=_grant).granted
    absent = probe_amx(frozenset({"avx2"}), syscall=_grant)
    assert (absent.advertised, absent.granted) == (False, False)
    assert "amx_tile" in absent.reason
    monkeypatch.setenv(os_grant.NO_AMX_ENV, "1")
    assert probe_amx(AMX, syscall=_grant) == Grant("amx", True, False, "BATON_NO_AMX is set")


@pytest.mark.skipif(not X86 or os_grant.platform.system() != "Linux", reason="x86-64 Linux probe")
def test_real_syscall_answers_without_crashing(monkeypatch):
    """The real arch_prctl: granted only where the CPU has AMX tile data and the OS allows it."""
    monkeypatch.delenv(os_grant.NO_AMX_ENV, raising=False)
    has_amx = loader.cpu_flags() >= os_grant.AMX_FLAGS
    grant = probe_amx(AMX)  # as if the CPU advertised AMX: a CPU without it makes the OS refuse
    assert grant.advertised
    if not has_amx:
        assert not grant.granted and "ARCH_REQ_XCOMP_PERM) failed with" in grant.reason


@pytest.mark.skipif(not X86, reason="AMX build flags are x86")
def test_refused_amx_is_compiled_out(monkeypatch):
    monkeypatch.delenv(loader.ISA_ENV, raising=False)
    monkeypatch.setattr(loader, "_cpu_features", lambda: "flags : fpu " + " ".join(sorted(AMX)))
    refused = Grant("amx", True, False, "refused")
    monkeypatch.setattr(loader, "amx_grant", lambda flags: refused)
    assert loader.isa_flags() == ("-march=native", *loader.NO_AMX_FLAGS)
    monkeypatch.setenv(loader.ISA_ENV, "avx2")
    assert loader.isa_flags() == ("-march=native", "-mno-avx512f", *loader.NO_AMX_FLAGS)
    monkeypatch.setenv(loader.ISA_ENV, "generic")
    assert loader.isa_flags() == ("-march=x86-64-v2",)
    monkeypatch.setattr(loader, "amx_grant", lambda flags: Grant("amx", True, True, "granted"))
    monkeypatch.delenv(loader.ISA_ENV)
    assert loader.isa_flags() == ("-march=native",)


def _paths(build: set[str], cpu: set[str], isa: str, amx: Grant) -> dict[str, report.KernelPath]:
    paths = report.kernel_paths(frozenset(build), frozenset(cpu), isa, amx)
    return {p.kernel: p for p in paths}


def test_linear_qp_line_says_whether_exact_linears_read_packed_rows(monkeypatch):
    none = Grant("amx", False, False, "the CPU does not advertise amx_tile")
    build = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512vnni"}
    cpu = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni"}
    monkeypatch.delenv(PACKED_EXACT_ENV, raising=False)

    def qp(vnni: bool, b: set[str] = build) -> report.KernelPath:
        flags = cpu if vnni else cpu - {"avx512_vnni"}
        feats = features_from("x86_64", frozenset(flags), "AuthenticAMD")
        monkeypatch.setattr("baton.kernels.exact_packing.cpu_features", lambda: feats)
        choice = packed_exact_choice()
        paths = report.kernel_paths(frozenset(b), frozenset(flags), "native", none, choice)
        return {p.kernel: p for p in paths}["linear_qp"]

    assert qp(True).path.startswith("exact decode-sized linears on the repacked rows")
    assert qp(True).why == "the CPU has avx512_vnni (the default there)"
    assert qp(False).path.startswith("not used") and "no avx512_vnni" in qp(False).why
    monkeypatch.setenv(PACKED_EXACT_ENV, "0")
    assert qp(True).why == f"{PACKED_EXACT_ENV}=0"
    # an AVX2 build has linear_qp's AVX2 loop (the choice says whether it runs); generic has none
    assert qp(True, {"avx2", "fma", "f16c"}).path.startswith("not used")
    assert qp(True, set()).path.startswith("not built")
    monkeypatch.setenv(PACKED_EXACT_ENV, "1")
    assert qp(False, {"avx2", "fma", "f16c"}).path.startswith("exact decode-sized linears")
    monkeypatch.delenv(PACKED_EXACT_ENV)
    assert "BATON_PACKED_EXACT=1 runs its AVX2 loop" in qp(False).why


def test_kernel_paths_follow_the_build():
    none = Grant("amx", False, False, "the CPU does not advertise amx_tile")
    zen4 = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni", "avx512_bf16"}
    build = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512vnni", "avx512bf16"}
    p = _paths(build, zen4, "native", none)
    assert p["linear_q"].path.startswith("AVX-512")
    assert p["linear_q8a"].path.startswith("AVX-512 VNNI")
    assert "avx512_vnni" in p["linear_q8a"].why
    assert p["linear_q8p"].path.startswith("AVX-512 VNNI on repacked rows")
    assert "four tiles at a time, prefetched into L1" in p["linear_q8p"].path
    assert p["bf16 linear (torch)"].path == "oneDNN AVX512-BF16 dot products"
    # how the loop streams the weights, and why (an AMD CPU: one tile at a time into L2)
    amd = PackedStream("l2", "an AMD CPU (the default there)")
    paths = report.kernel_paths(frozenset(build), frozenset(zen4), "native", none, stream=amd)
    q8p = {k.kernel: k for k in paths}
    assert "one tile at a time, prefetched into L2" in q8p["linear_q8p"].path
    assert "streaming: an AMD CPU (the default there)" in q8p["linear_q8p"].why
    # the same CPU with BATON_KERNEL_ISA=avx2: AVX-512 left out, and the report says by what
    p = _paths({"avx2", "fma", "f16c"}, zen4, "avx2", none)
    assert p["linear_q"].path.startswith("AVX2")
    assert p["linear_q"].why == "avx512f left out by BATON_KERNEL_ISA=avx2"
    assert p["linear_q8a"].path.startswith("AVX2: vpmaddubsw")
    assert p["linear_q8p"].path.startswith("AVX2 on repacked rows")
    assert p["linear_q8p"].why.startswith("avx512_vnni left out by BATON_KERNEL_ISA=avx2")
    # generic build on an AVX2-only CPU
    p = _paths(set(), {"avx2", "fma", "f16c"}, "generic", none)
    assert p["linear_q"].path.startswith("portable")
    assert p["linear_q8a"].path.startswith("portable")
    assert p["linear_q8p"].path.startswith("not built")
    assert p["linear_q8p"].why == "avx2 left out by BATON_KERNEL_ISA=generic"
    assert p["bf16 linear (torch)"].path == "emulated through float32"
    # an AMX CPU whose OS refuses tile data: the refusal is the reason, oneDNN is not sent there
    spr = zen4 | {"amx_tile", "amx_int8", "amx_bf16", "avx_vnni"}
    refused = Grant("amx", True, False, "the OS refused tile data")
    p = _paths(build, spr, "native", refused)
    assert p["amx tiles"].why == "amx_tile left out: the OS refused tile data"
    assert p["bf16 linear (torch)"].path == "oneDNN AVX512-BF16 dot products"
    assert "the OS refused tile data" in p["bf16 linear (torch)"].why
    granted = Grant("amx", True, True, "granted")
    assert _paths(build, spr, "native", granted)["bf16 linear (torch)"].path == (
        "oneDNN AMX-BF16 tiles"
    )
    assert "AMX-INT8 tiles" not in p["linear_q8p"].path
    assert p["linear_q8p"].why.endswith("tiles: amx_int8 left out: the OS refused tile data")
    assert p["bf16 decode stack"].path == "at::linear per linear, op by op"
    assert p["bf16 decode stack"].why == "no AMX tiles: the OS refused tile data"
    amx_build = build | {"amx_tile", "amx_int8", "amx_bf16"}
    p = _paths(amx_build, spr, "native", granted)
    assert p["linear_q8p"].path.endswith("AMX-INT8 tiles from 12 rows")
    assert p["amx tiles"].path.startswith("linear_q8p: AMX-INT8")
    assert p["bf16 decode stack"].path.startswith("oneDNN brgemm on AMX-BF16 tiles")
    # granted, but a build without the bf16 instructions (BATON_KERNEL_ISA=avx2): op by op
    p = _paths(build - {"avx512bf16"} | {"amx_bf16"}, spr, "avx2", granted)
    assert p["bf16 decode stack"].why == "the kernels were built without amx_bf16 / avx512bf16"


@pytest.mark.skipif(loader.compiler() is None, reason="no C++ compiler: the kernels cannot build")
def test_baton_env_reports_this_machine_with_amx_refused():
    """`baton env --json` in a process where AMX counts as refused (BATON_NO_AMX, as a hypervisor
    that does not grant it): the kernels build and run, with no tile code compiled in."""
    env = {**os.environ, os_grant.NO_AMX_ENV: "1"}
    env.pop(loader.ISA_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "env", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["kernels_built"], got["kernels_error"]
    (amx,) = got["grants"]
    assert not amx["granted"]
    assert set(got["flags"]) <= set(report.SHOWN_FLAGS)
    kernels = {k["kernel"]: k for k in got["kernels"]}
    assert {"linear_q", "linear_q8a", "paged_decode", "linear_small"} <= kernels.keys()
    assert all(k["why"] for k in got["kernels"])
    if amx["advertised"]:
        assert amx["reason"] == "BATON_NO_AMX is set"
        assert "-mno-amx-tile" in got["cxx_flags"]
        assert "amx_tile" not in got["build_isa"]
    if "avx512f" in got["flags"]:
        assert "avx512f" in got["build_isa"]
        assert kernels["linear_q"]["path"].startswith("AVX-512")


@pytest.mark.skipif(loader.compiler() is None, reason="no C++ compiler: the kernels cannot build")
def test_no_build_reports_at_once_where_nothing_is_built(tmp_path):
    """`baton env --no-build` with an empty kernel cache: no compile, the report says why."""
    env = {**os.environ, loader.KERNEL_DIR_ENV: str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "env", "--json", "--no-build"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert not got["kernels_built"] and got["kernels"] == []
    assert got["kernels_error"] == "not built on this machine yet"
    assert list(tmp_path.iterdir()) == []  # nothing compiled
