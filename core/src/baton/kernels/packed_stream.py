"""How the packed linears' VNNI loop streams weights at decode sizes (``BATON_PACKED_STREAM``).

A decode step reads every weight from memory once, so the loop's memory access decides its speed.
``"l2"``: one 16-row tile at a time, its blocks prefetched into L2; ``"l1"``: four tiles at a time
(two from three rows of x), prefetched into L1. On AMD Zen 4 ``"l2"`` made batch-1 exact decode
1.26x faster (int8 activations 1.27-1.37x): a core has few L1 miss buffers, and four interleaved
streams of a few KB leave the hardware prefetchers little to follow (docs/cpu-kernels.md). The
library picks ``"l2"`` on AMD CPUs and ``"l1"`` elsewhere (the Intel figures were measured with
it); the variable overrides it. Either way each output is summed in the same order: the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.kernels.cpu_features import cpu_features
from baton.kernels.switches import env_switch

#: "l1" or "l2" whatever the CPU; unset: by CPU vendor (packed_stream_choice)
PACKED_STREAM_ENV = "BATON_PACKED_STREAM"
AMD_VENDOR = "AuthenticAMD"


@dataclass(frozen=True)
class PackedStream:
    """The loop's streaming mode (what the library reads) and why (``baton env`` prints it)."""

    mode: str
    why: str


def packed_stream_choice(vendor: str | None = None) -> PackedStream:
    """BATON_PACKED_STREAM when set, else "l2" on AMD CPUs and "l1" elsewhere, as the library
    decides (``vendor``: /proc/cpuinfo's vendor_id unless given); ConfigError for a bad value."""
    value = env_switch(PACKED_STREAM_ENV, {mode: describe(mode) for mode in ("l2", "l1")})
    if value:
        return PackedStream(value, f"{PACKED_STREAM_ENV}={value}")
    vendor = cpu_features().vendor if vendor is None else vendor
    if vendor == AMD_VENDOR:
        return PackedStream("l2", "an AMD CPU (the default there)")
    return PackedStream("l1", f"not an AMD CPU ({vendor or 'vendor unknown'}; the default there)")


def describe(mode: str) -> str:
    """A streaming mode in words, for ``baton env``."""
    if mode == "l2":
        return "one tile at a time, prefetched into L2"
    return "four tiles at a time, prefetched into L1"
