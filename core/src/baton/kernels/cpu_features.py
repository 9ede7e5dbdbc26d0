"""Which 16-bit float types this CPU computes natively, detected at run time.

bfloat16 / float16 tensors run on any CPU, but without the instructions below
torch converts every element to float32 and back around each op (emulation),
which costs more than computing in float32. ``model.dtype`` uses this to pick
``auto``'s dtype on CPU and to warn about an emulated explicit choice.

- x86-64: bfloat16 with ``avx512_bf16`` or ``amx_bf16``; float16 with
  ``avx512_fp16`` or ``amx_fp16`` (from ``/proc/cpuinfo``, or torch's own
  probes where the file is missing).
- aarch64: bfloat16 with ``bf16``; float16 with ``asimdhp`` (half-precision
  vector arithmetic).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
#: Flags that give native arithmetic in each dtype, by architecture.
NATIVE_FLAGS: dict[str, dict[torch.dtype, frozenset[str]]] = {
    "x86_64": {
        torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
        torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
    },
    "aarch64": {
        torch.bfloat16: frozenset({"bf16"}),
        torch.float16: frozenset({"asimdhp"}),
    },
}
#: Flags also shown by ``describe`` (the vector units a float32 figure depends on).
CONTEXT_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "asimd", "sve"})
_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's architecture, the flags that matter here, and which 16-bit types are native."""

    arch: str
    flags: frozenset[str] = field(repr=False)
    bf16: bool
    fp16: bool
    #: ``vendor_id`` from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``), "" where unknown
    vendor: str = ""

    def native(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` arithmetic runs in hardware (float32 always does)."""
        if dtype == torch.bfloat16:
            return self.bf16
        if dtype == torch.float16:
            return self.fp16
        return True

    def describe(self) -> str:
        """``arch`` and the flags found, for logs and bench output."""
        native = sorted(self.flags & _native_flags(self.arch))
        shown = sorted(self.flags & CONTEXT_FLAGS) + (native or ["no native bf16/fp16 flag"])
        return f"{self.arch} ({' '.join(shown)})"


def _native_flags(arch: str) -> frozenset[str]:
    return frozenset().union(*NATIVE_FLAGS.get(arch, {}).values())


def features_from(arch: str, flags: frozenset[str], vendor: str = "") -> CpuFeatures:
    """The features an ``arch`` CPU with ``flags`` has (pure: what the tests feed)."""
    arch = _ARCH_ALIASES.get(arch.lower(), arch.lower())
    table = NATIVE_FLAGS.get(arch, {})
    return CpuFeatures(
        arch=arch,
        flags=flags,
        bf16=bool(flags & table.get(torch.bfloat16, frozenset())),
        fp16=bool(flags & table.get(torch.float16, frozenset())),
        vendor=vendor,
    )


def read_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's ``flags`` (x86) or ``Features`` (arm) from ``cpuinfo``; empty when unreadable."""
    value = _first_field(cpuinfo, ("flags", "Features"))
    return frozenset(value.split()) if value is not None else frozenset()


def read_vendor(cpuinfo: Path = CPUINFO) -> str:
    """The first CPU's ``vendor_id`` (x86) from ``cpuinfo``; "" when absent or unreadable."""
    value = _first_field(cpuinfo, ("vendor_id",))
    return value.strip() if value is not None else ""


def _first_field(cpuinfo: Path, keys: tuple[str, ...]) -> str | None:
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in keys:
            return value
    return None


def _torch_flags() -> frozenset[str]:
    """x86 flags from torch's own CPUID probes (where /proc/cpuinfo is missing, e.g. macOS, Windows)."""
    probes = {
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_tile": "_is_amx_tile_supported",  # every AMX CPU has amx_bf16 too
        "amx_fp16": "_is_amx_fp16_supported",
    }
    found = set()
    for flag, name in probes.items():
        probe = getattr(torch.cpu, name, None)
        if probe is not None and probe():
            found.add("amx_bf16" if flag == "amx_tile" else flag)
    return frozenset(found)


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's features, detected once per process."""
    arch = platform.machine()
    flags = read_flags()
    if not flags and _ARCH_ALIASES.get(arch.lower(), arch.lower()) == "x86_64":
        flags = _torch_flags()
    return features_from(arch, flags, read_vendor())


def native_compute(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``device`` computes ``dtype`` in hardware: on CPU by its flags; CUDA bfloat16 from
    Ampere on; every other case is taken as native."""
    if device.type == "cpu":
        return cpu_features().native(dtype)
    if device.type == "cuda" and dtype == torch.bfloat16:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return True
