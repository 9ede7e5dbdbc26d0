"""Whether the OS lets this process use the CPU features that need its permission (Intel AMX).

A CPU can advertise AMX (``amx_tile`` in ``/proc/cpuinfo``) while the kernel or a hypervisor
refuses its tile state: Linux enables AMX tile data per process only after
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` succeeds, and the first tile
instruction without it kills the process with SIGILL. llama.cpp's AMX build crashes that way on
some virtual machines. baton asks once per process, before any kernel is built; where the answer
is no, the kernels are compiled without AMX (``loader.isa_flags``) and the report says why.

``BATON_NO_AMX=1`` treats AMX as refused, as such a host would (for a host whose AMX misbehaves,
and for tests); torch's own oneDNN kernels follow ``ONEDNN_MAX_CPU_ISA`` instead.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
from collections.abc import Callable

import msgspec

NO_AMX_ENV = "BATON_NO_AMX"
#: arch_prctl codes (linux/arch/x86/include/uapi/asm/prctl.h) and the x86-64 syscall number.
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158
#: What a tile kernel needs from ``/proc/cpuinfo`` (amx_bf16 / amx_int8 name the tile operations).
AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})

#: ``syscall(number, code, argument)`` -> (return value, errno): what the probe calls.
Syscall = Callable[[int, int, int], tuple[int, int]]


class Grant(msgspec.Struct, frozen=True):
    """A CPU feature's state for this process: advertised by the CPU, granted by the OS, and why."""

    feature: str
    advertised: bool
    granted: bool
    reason: str


def _libc_syscall(number: int, code: int, arg: int) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_long(code), ctypes.c_ulong(arg))
    return int(rc), ctypes.get_errno()


def probe_amx(flags: frozenset[str], syscall: Syscall = _libc_syscall) -> Grant:
    """Ask the OS for AMX tile data (idempotent); ``syscall`` is injectable for tests."""
    missing = sorted(AMX_FLAGS - flags)
    if missing:
        return Grant("amx", False, False, f"the CPU does not advertise {' '.join(missing)}")
    if os.environ.get(NO_AMX_ENV, "").strip() not in ("", "0"):
        return Grant("amx", True, False, f"{NO_AMX_ENV} is set")
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return Grant("amx", True, False, f"no AMX permission probe on {platform.system()}")
    rc, err = syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc != 0:
        name = errno.errorcode.get(err, str(err))
        return Grant(
            "amx",
            True,
            False,
            f"the OS refused tile data: arch_prctl(ARCH_REQ_XCOMP_PERM) failed with {name} "
            "(a kernel before 5.16, or a hypervisor that does not pass AMX state through)",
        )
    return Grant("amx", True, True, "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) granted")


@functools.cache
def amx_grant(flags: frozenset[str]) -> Grant:
    """``probe_amx`` once per process and set of flags."""
    return probe_amx(flags)
