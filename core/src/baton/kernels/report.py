"""What this CPU is and the path each of baton's kernels takes on it, and why.

The kernels pick their code paths from the instruction sets they are compiled for (``-march=native``
on the machine that runs them, narrowed by ``$BATON_KERNEL_ISA`` and by what the OS grants:
``os_grant``). ``collect()`` reads the CPU's flags, asks the OS about AMX, loads the kernels and
asks the build which instruction sets it has (``torch.ops.baton.build_isa``), and names the path
of every kernel with the reason. ``baton env`` prints it; ``baton bench`` records it in its JSON.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import msgspec
import torch

from baton.kernels import loader
from baton.kernels.exact_packing import PackedExact, packed_exact_choice
from baton.kernels.os_grant import Grant, amx_grant
from baton.kernels.packed_stream import PackedStream, describe, packed_stream_choice

#: cpuinfo flags shown in the report: the vector and matrix units the kernels and torch use.
SHOWN_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "amx_fp16",
    "asimd",
    "sve",
)
#: A build macro's name (build_info.cpp) -> the cpuinfo flag of the same feature.
CPU_FLAG = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avxvnni": "avx_vnni"}


class KernelPath(msgspec.Struct, frozen=True):
    """One kernel (or torch op baton relies on), the code path it takes here, and why."""

    kernel: str
    path: str
    why: str


class CpuReport(msgspec.Struct, frozen=True):
    """The CPU, the OS's grants, the kernel build and each kernel's path (``baton env``)."""

    cpu: str
    arch: str
    flags: list[str]
    grants: list[Grant]
    kernel_isa: str
    cxx_flags: list[str]
    kernels_built: bool
    build_isa: list[str]
    kernels: list[KernelPath]
    torch_version: str
    torch_cpu_capability: str
    torch_threads: int
    python: str
    kernels_error: str | None = None


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (first ``model name`` line), else what ``platform`` says."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Why:
    """Why a build has or lacks an instruction set, from the CPU, $BATON_KERNEL_ISA and the OS."""

    def __init__(self, cpu: frozenset[str], build: frozenset[str], isa: str, amx: Grant) -> None:
        self.cpu, self.build, self.isa, self.amx = cpu, build, isa, amx

    def __call__(self, feature: str) -> str:
        flag = CPU_FLAG.get(feature, feature)
        if feature in self.build:
            return f"built with {flag} (the CPU has it; {loader.ISA_ENV}={self.isa})"
        if flag.startswith("amx") and self.amx.advertised and not self.amx.granted:
            return f"{flag} left out: {self.amx.reason}"
        if flag in self.cpu:
            return f"{flag} left out by {loader.ISA_ENV}={self.isa}"
        return f"the CPU has no {flag}"


#: kernel_paths' default: exact linears on ggml's rows
NOT_PACKED = PackedExact(False, "not asked")
#: kernel_paths' default streaming of the packed loop (what the library does off AMD)
L1_STREAM = PackedStream("l1", "not asked")


def kernel_paths(
    build: frozenset[str],
    cpu: frozenset[str],
    isa: str,
    amx: Grant,
    exact_packed: PackedExact = NOT_PACKED,
    stream: PackedStream = L1_STREAM,
) -> list[KernelPath]:
    """The path each kernel takes for a build with the macros ``build`` (pure: tests feed it);
    ``exact_packed``: what exact_packing.packed_exact_choice() says, ``stream``: how the packed
    VNNI loop streams weights (packed_stream.packed_stream_choice())."""
    why = _Why(cpu, build, isa, amx)
    if "avx512f" in build:
        float_q = KernelPath("linear_q", "AVX-512: 16-float vectors", why("avx512f"))
        small = KernelPath(
            "linear_small", "AVX-512: 16-float vectors, 32 registers", why("avx512f")
        )
    elif "avx2" in build:
        float_q = KernelPath("linear_q", "AVX2: 8-float vectors", why("avx512f"))
        small = KernelPath("linear_small", "8-float vectors, 16 registers", why("avx512f"))
    else:
        float_q = KernelPath("linear_q", "portable: 4-float vectors", why("avx2"))
        small = KernelPath("linear_small", "8-float vectors (compiler-lowered)", why("avx512f"))
    if "avx2" in build and "avx512vnni" in build and "avx512vl" in build:
        q8 = KernelPath("linear_q8a", "AVX-512 VNNI: vpdpbusd, 256-bit", why("avx512vnni"))
    elif "avx2" in build:
        q8 = KernelPath("linear_q8a", "AVX2: vpmaddubsw + vpmaddwd", why("avx512vnni"))
    else:
        q8 = KernelPath("linear_q8a", "portable: scalar int8 dot products", why("avx2"))
    if "avx512vnni" in build and "avx512bw" in build:
        tiles_too = "amx_int8" in build and amx.granted
        q8p = KernelPath(
            "linear_q8p",
            "AVX-512 VNNI on repacked rows (Q4_0, Q4_1, Q8_0): 16 outputs per vpdpbusd, "
            + describe(stream.mode)
            + ("; AMX-INT8 tiles from 12 rows" if tiles_too else ""),
            why("avx512vnni")
            + "; int8 activations repack these formats at load and quantize prefill too"
            + f"; streaming: {stream.why}"
            + ("" if tiles_too else "; tiles: " + why("amx_int8")),
        )
    elif {"avx2", "fma", "f16c"} <= build:
        q8p = KernelPath(
            "linear_q8p",
            "AVX2 on repacked rows (Q4_0, Q4_1, Q8_0): 8 outputs per vpmaddubsw + vpmaddwd",
            why("avx512vnni") + "; int8 activations repack these formats at load and quantize "
            "prefill too",
        )
    else:
        q8p = KernelPath(
            "linear_q8p",
            "not built: int8 activations read ggml's rows (linear_q8a)",
            why("avx2"),
        )
    qp = _exact_packed_path(not q8p.path.startswith("not built"), exact_packed, why("avx2"))
    if "avx2" in build and "f16c" in build:
        attn = KernelPath("paged_decode", "AVX2 + F16C cache conversions", why("f16c"))
    else:
        attn = KernelPath("paged_decode", "portable cache conversions", why("f16c"))
    tiles = KernelPath(
        "linear_q_tiles",
        f"dequantized tiles + torch GEMM ({torch.backends.cpu.get_cpu_capability()})",
        "many rows (prefill): a whole-matrix GEMM per tile beats per-row dot products",
    )
    if amx.granted and "amx_int8" in build and "avx512vnni" in build:
        amx_path = KernelPath(
            "amx tiles",
            "linear_q8p: AMX-INT8 TDPBSUD from 12 rows of x (int8 activations)",
            amx.reason + "; bfloat16 linears take oneDNN's tiles (bf16 linear rows)",
        )
    else:
        amx_path = KernelPath("amx tiles", "not used", why("amx_tile"))
    return [float_q, q8, q8p, qp, small, attn, tiles, amx_path, *_bf16_paths(build, cpu, amx)]


def _exact_packed_path(built: bool, choice: PackedExact, isa_why: str) -> KernelPath:
    """linear_qp's line: exact decode-sized linears on linear_q8p's repacked rows, or not."""
    if not built:
        return KernelPath(
            "linear_qp", "not built: exact linears read ggml's rows (linear_q)", isa_why
        )
    if choice.on:
        return KernelPath(
            "linear_qp",
            "exact decode-sized linears on the repacked rows (Q4_0, Q4_1, Q8_0): x in three "
            "int8 pieces, three integer dot products per block",
            choice.why,
        )
    return KernelPath(
        "linear_qp", "not used: exact linears read ggml's rows (linear_q)", choice.why
    )


def _bf16_paths(build: frozenset[str], cpu: frozenset[str], amx: Grant) -> list[KernelPath]:
    """What ``model.dtype = bfloat16`` linears run on: torch's (oneDNN) in transformers' modules,
    and in fast decode's native stack."""
    if amx.granted and {"amx_bf16", "avx512bf16"} <= build:
        stack = KernelPath(
            "bf16 decode stack",
            "oneDNN brgemm on AMX-BF16 tiles, weights packed at load, one parallel region",
            amx.reason + " (where oneDNN packs bf16: torch.ops.baton.bf16_tiles())",
        )
    else:
        stack = KernelPath(
            "bf16 decode stack", "at::linear per linear, op by op", why_no_tiles(build, amx)
        )
    return [_bf16_path(cpu, amx), stack]


def why_no_tiles(build: frozenset[str], amx: Grant) -> str:
    if not amx.granted:
        return f"no AMX tiles: {amx.reason}"
    return "the kernels were built without amx_bf16 / avx512bf16"


def _bf16_path(cpu: frozenset[str], amx: Grant) -> KernelPath:
    """What torch (oneDNN) runs ``model.dtype = bfloat16`` linears on."""
    if amx.granted and "amx_bf16" in cpu:
        return KernelPath("bf16 linear (torch)", "oneDNN AMX-BF16 tiles", amx.reason)
    if "avx512_bf16" in cpu:
        why = "avx512_bf16" + (f"; AMX not used: {amx.reason}" if amx.advertised else "")
        return KernelPath("bf16 linear (torch)", "oneDNN AVX512-BF16 dot products", why)
    return KernelPath(
        "bf16 linear (torch)",
        "emulated through float32",
        "no avx512_bf16 or amx_bf16: model.dtype=auto runs float32 here",
    )


def collect(build_kernels: bool = True) -> CpuReport:
    """This machine's report; ``build_kernels=False``: the kernels are loaded if this machine has
    built them, never compiled (a report that must answer at once)."""
    cpu = loader.cpu_flags()
    amx = amx_grant(cpu)
    isa = os.environ.get(loader.ISA_ENV, "native").strip().lower() or "native"
    error = None
    try:
        flags = list(loader.cxx_flags())
    except loader.KernelBuildError as e:
        flags, error = [], str(e)
    built = error is None and loader.load(build_missing=build_kernels)
    if built:
        build = frozenset(torch.ops.baton.build_isa().split())
    else:
        why = "not built on this machine yet" if not build_kernels else "did not build: see the log"
        error, build = error or why, frozenset()
    return CpuReport(
        cpu=cpu_name(),
        arch=platform.machine(),
        flags=[f for f in SHOWN_FLAGS if f in cpu],
        grants=[amx],
        kernel_isa=isa,
        cxx_flags=flags,
        kernels_built=built,
        build_isa=sorted(build),
        kernels=kernel_paths(build, cpu, isa, amx, packed_exact_choice(), library_stream())
        if built
        else [],
        torch_version=str(torch.__version__),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        torch_threads=torch.get_num_threads(),
        python=sys.version.split()[0],
        kernels_error=error,
    )


def library_stream() -> PackedStream:
    """The packed loop's streaming as the loaded library does it, with the reason."""
    choice = packed_stream_choice()
    return PackedStream(str(torch.ops.baton.packed_stream()), choice.why)


def render(report: CpuReport) -> str:
    """The report as text (``baton env`` without --json)."""
    lines = [
        f"CPU:            {report.cpu} ({report.arch})",
        f"flags:          {' '.join(report.flags) or '(none of the ones baton uses)'}",
        *(
            f"{g.feature}:            {'granted' if g.granted else 'not used'}: {g.reason}"
            for g in report.grants
        ),
        f"kernel build:   {loader.ISA_ENV}={report.kernel_isa}  {' '.join(report.cxx_flags)}",
        f"build ISA:      {' '.join(report.build_isa) or '-'}",
        f"torch:          {report.torch_version}, CPU capability {report.torch_cpu_capability}, "
        f"{report.torch_threads} threads; Python {report.python}",
    ]
    if report.kernels_error:
        lines.append(f"kernels:        unavailable: {report.kernels_error}")
    width = max((len(k.kernel) for k in report.kernels), default=0)
    lines += [
        f"  {k.kernel:<{width}}  {k.path}\n  {'':<{width}}  why: {k.why}" for k in report.kernels
    ]
    return "\n".join(lines)
