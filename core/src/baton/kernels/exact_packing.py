"""Whether exact (float32-activation) decode-sized linears read repacked rows (``linear_qp``).

``linear_qp`` (kernels/packed_q8.cpp) reads Q4_0 / Q4_1 / Q8_0 rows repacked once at load for
AVX-512 VNNI and splits x into three int8 pieces per 32 values: the same sums as ``linear_q``
within a float32 rounding per block, 1.8x faster at one row on an Intel Xeon with AMX and 1.2x
on AMD Zen 4 (30 SmolLM2 layers of Q4_1, two threads, docs/cpu-kernels.md). The packed rows
replace the GGUF rows (prefill and the embedding unpack them with the same bits): no more memory.
A build without VNNI runs it on an AVX2 loop with the same bits; that is opt-in
(``BATON_PACKED_EXACT=1``) until measured on a CPU without AVX-512.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.kernels.cpu_features import cpu_features
from baton.kernels.switches import env_switch

#: "1" or "0": exact decode-sized calls on packed rows (linear_qp) or on the GGUF rows
#: (linear_q), whatever the CPU; unset: as packed_exact_default says.
PACKED_EXACT_ENV = "BATON_PACKED_EXACT"


@dataclass(frozen=True)
class PackedExact:
    """Whether exact decode-sized calls run linear_qp, and why (``baton env`` prints it)."""

    on: bool
    why: str


def packed_exact_choice() -> PackedExact:
    """BATON_PACKED_EXACT when set, else packed_exact_default(), with the reason."""
    value = env_switch(
        PACKED_EXACT_ENV, {"1": "exact linears on packed rows", "0": "on the GGUF rows"}
    )
    if value:
        return PackedExact(value == "1", f"{PACKED_EXACT_ENV}={value}")
    if packed_exact_default():
        return PackedExact(True, "the CPU has avx512_vnni (the default there)")
    return PackedExact(
        False,
        "the CPU has no avx512_vnni (linear_qp's default there; BATON_PACKED_EXACT=1 runs its AVX2 loop)",
    )


def packed_exact() -> bool:
    """Whether exact decode-sized calls run linear_qp where a format packs (packed_exact_choice)."""
    return packed_exact_choice().on


def packed_exact_default() -> bool:
    """Wherever the CPU has AVX-512 VNNI (linear_qp's instruction set): three vpdpbusd per block
    beat linear_q's float decode there, at one row by 1.8x on an Intel Xeon with AMX and by 1.2x
    on AMD Zen 4, which runs 512-bit VNNI as two halves (batch-1 exact decode +28% there); equal
    or ahead up to 16 rows on both (docs/benchmarks.md). The AVX2 loop was faster than linear_q
    at 1-16 rows too, but measured only as an AVX2 build on Zen 4, whose vpmaddubsw runs on two
    pipes (one on Zen 2 and Haswell): not the default until a CPU without AVX-512 says so."""
    return "avx512_vnni" in cpu_features().flags
