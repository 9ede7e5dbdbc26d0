"""linear_q8p and linear_qp: weights repacked for AVX-512 VNNI (kernels/packed_q8.cpp).

linear_q8p quantizes x exactly as linear_q8a does, so both give the same values up to float
summation order. linear_qp (exact) splits x into three int8 pieces: as accurate as linear_q's
float32 sums. Without VNNI both run an AVX2 loop with the VNNI loop's bits. Either way a row's
result does not depend on the rows beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from baton.errors import ConfigError
from baton.kernels import cpu_features, loader
from baton.kernels.exact_packing import PACKED_EXACT_ENV, packed_exact, packed_exact_default
from baton.kernels.packed_stream import AMD_VENDOR, PACKED_STREAM_ENV, packed_stream_choice
from baton.quant import QType, QuantEmbedding, QuantLinear
from baton.quant.ops import packs_rows
from baton.testing.threads import torch_threads

pytestmark = pytest.mark.skipif(
    not loader.load(), reason="baton's CPU kernels do not build here (no C++ compiler)"
)


def _built() -> bool:
    return loader.load() and bool(torch.ops.baton.q8p_kernel())


needs_q8p = pytest.mark.skipif(
    not _built(),
    reason="the kernels are built without AVX-512 VNNI or AVX2: linear_q8p / linear_qp are not "
    "compiled",
)


#: bytes per 32-weight block and the float16 header (d, or d and m) of each packable format
FORMATS = {
    QType.Q4_0: (18, [0.01]),
    QType.Q4_1: (20, [0.01, -0.004]),
    QType.Q8_0: (34, [0.003]),
}


def random_rows(n: int, k: int, qtype: QType, seed: int = 0) -> torch.Tensor:
    """n rows of k weights in ``qtype``: random quants, a fixed header (any bytes are valid)."""
    size, header = FORMATS[qtype]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * (k // 32), size), dtype=torch.uint8, generator=g)
    raw[:, : 2 * len(header)] = torch.tensor(header).half().view(torch.uint8)
    return raw.view(n, -1).contiguous()


@needs_q8p
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize(("n", "k"), [(576, 576), (192, 1536), (48, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
def test_packed_rows_agree_with_linear_q8a(qtype, n, k, rows):
    w = random_rows(n, k, qtype)
    packed = torch.ops.baton.pack_q8p(w, int(qtype))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    want = torch.ops.baton.linear_q8a(x, w, int(qtype), bias)
    got = torch.ops.baton.linear_q8p(x, packed, int(qtype), bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_pack_refuses_what_it_cannot_lay_out():
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        torch.ops.baton.pack_q8p(random_rows(40, 64, QType.Q4_1), int(QType.Q4_1))
    with pytest.raises(RuntimeError, match="has no packed layout"):
        torch.ops.baton.pack_q8p(torch.zeros(16, 144, dtype=torch.uint8), int(QType.Q4_K))
    assert not packs_rows(QType.Q4_K, 64)
    assert not packs_rows(QType.Q4_1, 40)


@needs_q8p
def test_quant_linear_packs_while_int8_activations_are_on(monkeypatch):
    monkeypatch.setenv(PACKED_EXACT_ENV, "0")  # exact calls on ggml's rows: packed only for int8
    w = random_rows(64, 128, QType.Q4_1, seed=9)
    lin = QuantLinear(w, QType.Q4_1, 128, 64, bias=torch.randn(64), kernels=True)
    before = lin.weight_bytes
    lin.int8_activations = True
    assert lin.packed is not None and lin.weight_bytes == before + lin.packed.numel()
    x = torch.randn(3, 128)
    want = torch.ops.baton.linear_q8a(x, lin.raw, int(QType.Q4_1), lin.bias)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-4)
    assert "packed" not in lin.state_dict()  # derived from raw, never saved
    lin.int8_activations = False
    assert lin.packed is None and lin.weight_bytes == before
    # prefill-sized calls quantize x too, on the packed rows (as llama.cpp's prompt processing)
    lin.int8_activations = True
    assert lin.max_kernel_rows == QuantLinear.PACKED_INT8_MAX_ROWS
    big = torch.randn(2 * QuantLinear.KERNEL_MAX_ROWS + 5, 128)
    assert torch.equal(
        lin(big), torch.ops.baton.linear_q8p(big, lin.packed, int(QType.Q4_1), lin.bias)
    )
    torch.testing.assert_close(
        lin(big),
        torch.ops.baton.linear_q8a(big, lin.raw, int(QType.Q4_1), lin.bias),
        rtol=1e-5,
        atol=1e-4,
    )


def _relative_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - x @ w.T| / (|x| @ |w|.T), the reference in float64."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    return float(((y.double() - ref).abs() / scale.clamp_min(1e-300)).max())


@needs_q8p
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 5, 16])
def test_linear_qp_is_as_accurate_as_the_float_kernel(qtype, rows):
    """x in three int8 pieces: within float32 rounding of x @ dequantize(w).T, as linear_q is
    (an int8 x, linear_q8p, is ~1e-3 off; two pieces would be ~1e-5). The pieces resolve each
    value to 2^-24 of its block's largest: a value far below its block's largest keeps fewer
    bits than a float32 would (the bound below), as in any block floating point."""
    w = random_rows(192, 1536, qtype, seed=rows)
    wd = torch.empty(192, 1536)
    torch.ops.baton.dequantize_q(w, int(qtype), wd)
    packed = torch.ops.baton.pack_q8p(w, int(qtype))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1536, generator=g) * torch.randn(rows, 1536, generator=g).exp()
    x[0, :32] = 0.0  # a block of zeros: no scale to divide by
    exact = _relative_error(torch.ops.baton.linear_qp(x, packed, int(qtype)), x, wd)
    floats = _relative_error(torch.ops.baton.linear_q(x, w, int(qtype)), x, wd)
    int8 = _relative_error(torch.ops.baton.linear_q8p(x, packed, int(qtype)), x, wd)
    assert exact < 1e-6 and floats < 1e-6 and int8 > 1e-4, (exact, floats, int8)
    bias = torch.randn(192, generator=g)
    with_bias = torch.ops.baton.linear_qp(x, packed, int(qtype), bias)
    assert torch.equal(with_bias, torch.ops.baton.linear_qp(x, packed, int(qtype)) + bias)
    # one value 10^7 times its block's others: their error is bounded by the block's largest
    x[-1, 32:64] = torch.tensor([-1e4] + [1e-3] * 31)
    err = (
        torch.ops.baton.linear_qp(x, packed, int(qtype)).double() - x.double() @ wd.double().T
    ).abs()
    blocks = x.double().abs().view(rows, -1, 32).amax(-1)  # [rows, K / 32]
    bound = blocks @ wd.double().abs().view(192, -1, 32).sum(-1).T * 2.0**-23  # [rows, 192]
    bound += (x.double().abs() @ wd.double().abs().T) * 1e-6  # the float steps after the sums
    assert bool((err <= bound).all()), float((err / bound).max())


@needs_q8p
@pytest.mark.parametrize("op", ["linear_q8p", "linear_qp"])
@pytest.mark.parametrize("qtype", list(FORMATS))
def test_a_row_does_not_depend_on_the_rows_beside_it_or_the_threads(qtype, op):
    linear = getattr(torch.ops.baton, op)
    w = random_rows(320, 576, qtype, seed=3)
    packed = torch.ops.baton.pack_q8p(w, int(qtype))
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(5))
    together = linear(x, packed, int(qtype))
    with torch_threads(1):
        one_thread = linear(x, packed, int(qtype))
    assert torch.equal(one_thread, together)
    for i in (0, 1, 4, 10, 11, 12, 16, 36):
        alone = linear(x[i : i + 1], packed, int(qtype))
        assert torch.equal(alone[0], together[i]), i


@needs_q8p
def test_exact_quant_linear_runs_linear_qp_on_rows_packed_once(monkeypatch):
    monkeypatch.setenv(PACKED_EXACT_ENV, "1")
    w = random_rows(64, 128, QType.Q4_1, seed=9)
    lin = QuantLinear(w, QType.Q4_1, 128, 64, bias=torch.randn(64), kernels=True)
    # the packed rows replace ggml's: one copy, as many bytes
    assert lin.raw is None and lin.packed.numel() == w.numel()
    assert lin.weight_bytes == w.numel() + 64 * 4 and torch.equal(lin.ggml_rows(), w)
    assert "raw" not in lin.state_dict() and "packed" not in lin.state_dict()
    packed = lin.packed
    x = torch.randn(3, 128)
    assert torch.equal(lin(x), torch.ops.baton.linear_qp(x, packed, int(QType.Q4_1), lin.bias))
    lin.int8_activations = True  # the same bytes serve linear_q8p: not packed again
    assert lin.packed is packed
    assert torch.equal(lin(x), torch.ops.baton.linear_q8p(x, packed, int(QType.Q4_1), lin.bias))
    lin.int8_activations = False
    assert lin.packed is packed
    # linear_qp runs up to 64 rows on AMX tiles, at any row count on the VNNI loop (ahead of the
    # GEMM there), up to 16 on the AVX2 loop
    path = torch.ops.baton.q8p_path()
    rows = {"amx": QuantLinear.PACKED_AMX_MAX_ROWS, "vnni": QuantLinear.PACKED_VNNI_MAX_ROWS}
    assert lin.max_kernel_rows == rows.get(path, 16) and rows["amx"] == 64
    most = torch.randn(min(lin.max_kernel_rows, 300), 128)
    want = torch.ops.baton.linear_qp(most, packed, int(QType.Q4_1), lin.bias)
    assert torch.equal(lin(most), want)
    # prefill past the limit, the embedding and dequantized(): the bits of ggml's rows
    if path != "vnni":
        big = torch.randn(lin.max_kernel_rows + 1, 128)
        assert torch.equal(
            lin(big), torch.ops.baton.linear_q_tiles(big, w, int(QType.Q4_1), lin.bias)
        )
    full = torch.empty(64, 128)
    torch.ops.baton.dequantize_q(w, int(QType.Q4_1), full)
    assert torch.equal(lin.dequantized(), full) and torch.equal(lin.dequantized(5, 21), full[5:21])
    ids = torch.tensor([[3, 63], [0, 3]])
    assert torch.equal(QuantEmbedding(lin)(ids), full[ids])
    monkeypatch.setenv(PACKED_EXACT_ENV, "0")
    off = QuantLinear(w, QType.Q4_1, 128, 64, bias=lin.bias, kernels=True)
    assert off.packed is None and off.raw is w
    assert torch.equal(off(x), torch.ops.baton.linear_q(x, w, int(QType.Q4_1), lin.bias))


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_packed_rows_unpack_to_the_same_bytes_and_values(qtype):
    """unpack_q8p inverts pack_q8p; linear_qp_tiles and dequantize_q8p_rows give linear_q_tiles'
    and dequantize_q's bits on the rows packed (so prefill and the embedding do not change)."""
    w = random_rows(96, 1536, qtype, seed=2)
    packed = torch.ops.baton.pack_q8p(w, int(qtype))
    assert torch.equal(torch.ops.baton.unpack_q8p(packed, int(qtype)), w)
    x = torch.randn(37, 1536, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(96)
    assert torch.equal(
        torch.ops.baton.linear_qp_tiles(x, packed, int(qtype), bias),
        torch.ops.baton.linear_q_tiles(x, w, int(qtype), bias),
    )
    full = torch.empty(96, 1536)
    torch.ops.baton.dequantize_q(w, int(qtype), full)
    ids = torch.tensor([95, 0, 17, 17, 48])
    assert torch.equal(torch.ops.baton.dequantize_q8p_rows(packed, int(qtype), ids), full[ids])
    with pytest.raises(RuntimeError, match="row 96 of 96"):
        torch.ops.baton.dequantize_q8p_rows(packed, int(qtype), torch.tensor([96]))


def test_packed_exact_follows_the_variable_then_the_cpu(monkeypatch):
    monkeypatch.setenv(PACKED_EXACT_ENV, "2")
    with pytest.raises(ConfigError, match=f"{PACKED_EXACT_ENV}='2'"):
        packed_exact()
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv(PACKED_EXACT_ENV, value)
        assert packed_exact() is want
    monkeypatch.delenv(PACKED_EXACT_ENV)
    assert packed_exact() is packed_exact_default()
    # by the instruction set, not the vendor: Intel and AMD Zen 4 both measured faster
    for vendor, flags, want in (
        ("GenuineIntel", {"avx512_vnni"}, True),
        ("AuthenticAMD", {"avx512_vnni"}, True),
        ("AuthenticAMD", {"avx2", "fma"}, False),
        ("", set(), False),
    ):
        feats = cpu_features.features_from("x86_64", frozenset(flags), vendor)
        monkeypatch.setattr("baton.kernels.exact_packing.cpu_features", lambda f=feats: f)
        assert packed_exact_default() is want, (vendor, flags)


def test_packed_stream_follows_the_variable_then_the_vendor(monkeypatch):
    monkeypatch.setenv(PACKED_STREAM_ENV, "l3")
    with pytest.raises(ConfigError, match=f"{PACKED_STREAM_ENV}='l3'"):
        packed_stream_choice()
    for value in ("l1", "l2"):
        monkeypatch.setenv(PACKED_STREAM_ENV, value)
        assert packed_stream_choice("GenuineIntel").mode == value
    monkeypatch.delenv(PACKED_STREAM_ENV)
    assert packed_stream_choice(AMD_VENDOR).mode == "l2"
    assert packed_stream_choice("GenuineIntel").mode == "l1"
    assert packed_stream_choice("").mode == "l1"
    # the library decides by cpuid the way this does by /proc/cpuinfo
    want = packed_stream_choice().mode
    assert torch.ops.baton.packed_stream() == want


STREAM_RUN = """
import sys, torch
from baton.kernels import loader
assert loader.load()
cases = torch.load(sys.argv[1])
out = [getattr(torch.ops.baton, op)(x, packed, qtype, bias)
       for op in ("linear_q8p", "linear_qp") for packed, qtype, x, bias in cases]
torch.save((out, torch.ops.baton.packed_stream()), sys.argv[2])
"""


@needs_q8p
def test_both_ways_of_streaming_give_the_same_bits(tmp_path):
    """BATON_PACKED_STREAM=l1 (four tiles at a time) and l2 (one at a time), each in a process
    of its own (the library reads it once): every output is summed in the same order, so 1 to 37
    rows (every row-count path, the passes over L2-sized chunks) give the same bits."""
    cases = []
    for i, qtype in enumerate(FORMATS):
        for rows, (n, k) in zip(
            (1, 2, 3, 4, 9, 37), [(96, 1536), (48, 96), (576, 576)] * 2, strict=True
        ):
            w = random_rows(n, k, qtype, seed=10 * i + rows)
            g = torch.Generator().manual_seed(rows)
            x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
            cases.append((torch.ops.baton.pack_q8p(w, int(qtype)), int(qtype), x, bias))
    torch.save(cases, tmp_path / "in.pt")
    got = {}
    for mode in ("l1", "l2"):
        out = tmp_path / f"{mode}.pt"
        proc = subprocess.run(
            [sys.executable, "-c", STREAM_RUN, str(tmp_path / "in.pt"), str(out)],
            env={**os.environ, PACKED_STREAM_ENV: mode},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        ys, said = torch.load(out)
        assert said == mode
        got[mode] = ys
    for a, b in zip(got["l1"], got["l2"], strict=True):
        assert torch.equal(a, b)
    here = [
        getattr(torch.ops.baton, op)(x, packed, qtype, bias)
        for op in ("linear_q8p", "linear_qp")
        for packed, qtype, x, bias in cases
    ]
    assert all(torch.equal(a, b) for a, b in zip(here, got["l1"], strict=True))


def test_vendor_comes_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2\n")
    assert cpu_features.read_vendor(info) == "GenuineIntel"
    assert cpu_features.read_flags(info) == frozenset({"fpu", "avx2"})
    assert cpu_features.read_vendor(tmp_path / "missing") == ""


def test_no_packing_without_the_kernel(monkeypatch):
    monkeypatch.setattr(torch.ops.baton, "q8p_kernel", lambda: False, raising=False)
    lin = QuantLinear(random_rows(64, 128, QType.Q4_1), QType.Q4_1, 128, 64, kernels=True)
    lin.int8_activations = True
    assert lin.packed is None
    x = torch.randn(2, 128)
    torch.testing.assert_close(lin(x), torch.ops.baton.linear_q8a(x, lin.raw, int(QType.Q4_1)))


@needs_q8p
@pytest.mark.parametrize("op", ["linear_q8p", "linear_qp"])
@pytest.mark.parametrize("qtype", list(FORMATS))
def test_tiles_and_the_vnni_loop_give_the_same_bits(qtype, op):
    """An AMX build takes tiles from 12 rows (linear_q8p) or 8 (linear_qp), elsewhere the VNNI
    loop again: the integer sums are exact both ways and the float steps the same, so each row
    matches the row computed alone, in a full tile of 16 and in the last, partial ones."""
    linear = getattr(torch.ops.baton, op)
    w = random_rows(96, 1536, qtype, seed=4)
    packed = torch.ops.baton.pack_q8p(w, int(qtype))
    x = torch.randn(37, 1536, generator=torch.Generator().manual_seed(6))
    together = linear(x, packed, int(qtype))
    for i in (0, 11, 12, 16, 36):
        alone = linear(x[i : i + 1], packed, int(qtype))
        assert torch.equal(alone[0], together[i]), (torch.ops.baton.q8p_path(), i)
    for rows in (7, 8, 9):  # around linear_qp's switch: the loop at 7, tiles of 8 and 9 rows
        assert torch.equal(linear(x[:rows], packed, int(qtype)), together[:rows]), rows


REFUSED = """
import sys, torch
torch.ops.load_library(sys.argv[1])
g = torch.Generator().manual_seed(0)
raw = torch.randint(0, 256, (64 * 18, 20), dtype=torch.uint8, generator=g)
raw[:, :4] = torch.tensor([0.01, 0.001]).half().view(torch.uint8)
packed = torch.ops.baton.pack_q8p(raw.view(64, -1).contiguous(), 3)
x = torch.randn(16, 576, generator=g)
y = torch.ops.baton.linear_q8p(x, packed, 3)
z = torch.ops.baton.linear_qp(x, packed, 3)
print(torch.ops.baton.q8p_path(), float(y.abs().sum()), float(z.abs().sum()))
"""


@needs_q8p
def test_a_library_loaded_without_the_loader_asks_the_os_and_never_faults():
    """The library built here, loaded by a bare process that never ran baton's AMX probe, with
    AMX refused (BATON_NO_AMX, as a hypervisor that does not grant tile data): 16 rows, the tile
    row count, run the VNNI loop, no SIGILL; with AMX allowed the library asks the OS itself."""
    lib = str(loader.build())
    outs = {}
    for refused in (True, False):
        env = {k: v for k, v in os.environ.items() if k != "BATON_NO_AMX"}
        if refused:
            env["BATON_NO_AMX"] = "1"
        proc = subprocess.run(
            [sys.executable, "-c", REFUSED, lib], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, (refused, proc.returncode, proc.stderr[-2000:])
        outs[refused] = proc.stdout.split()
    here = torch.ops.baton.q8p_path()
    assert outs[True][0] == ("vnni" if here == "amx" else here)  # never tiles where refused
    assert outs[False][0] == torch.ops.baton.q8p_path()
    assert outs[True][1:] == outs[False][1:]  # the same bits either way


AVX2_RUN = """
import sys, torch
from baton.kernels import loader
assert loader.load()
cases = torch.load(sys.argv[1])
out = {}
for op in ("linear_q8p", "linear_qp"):
    f = getattr(torch.ops.baton, op)
    ys = [f(x, packed, qtype, bias) for packed, qtype, x, bias, _ in cases]
    alone = [f(x[i : i + 1], packed, qtype, bias)[0]
             for packed, qtype, x, bias, _ in cases for i in range(x.shape[0])]
    out[op] = (ys, alone)
tiles = [torch.equal(torch.ops.baton.linear_qp_tiles(x, packed, qtype, bias),
                     torch.ops.baton.linear_q_tiles(x, w, qtype, bias))
         for packed, qtype, x, bias, w in cases]
screened = [torch.ops.baton.linear_qp_argmax(
                x, packed, qtype, bias, torch.ops.baton.packed_row_bounds(packed, qtype))
            for packed, qtype, x, bias, _ in cases]
torch.save((out, tiles, screened, torch.ops.baton.q8p_path()), sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_features.cpu_features().flags
    or loader.platform.machine() not in ("x86_64", "AMD64"),
    reason="the AVX2 build needs a CPU with AVX2, FMA and F16C",
)
def test_the_avx2_loop_gives_the_bits_of_the_vnni_loop(tmp_path):
    """BATON_KERNEL_ISA=avx2 (what a CPU without AVX-512 builds), in a subprocess: linear_q8p and
    linear_qp on the same packed rows, each 64-byte vector as two halves of 8 rows (vpmaddubsw +
    vpmaddwd for vpdpbusd: the same integer sums, Q8_0's bytes through their signs), give
    linear_q8a's / linear_q's values, each row the same alone as beside others (1 to 37 rows:
    every row-count path, partial tiles), and, where this build has the VNNI loop, its bits;
    linear_qp_tiles (prefill: the AVX2 dequantization) gives linear_q_tiles' bits, and
    linear_qp_argmax linear_qp's where it keeps a tile (the same tiles as the VNNI build)."""
    cases = []
    for i, qtype in enumerate(FORMATS):
        shapes = [(96, 1536), (48, 96), (576, 576), (64, 128), (96, 1536)]
        for rows, (n, k) in zip((1, 2, 3, 5, 37), shapes, strict=True):
            w = random_rows(n, k, qtype, seed=10 * i + rows)
            g = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, k, generator=g)
            bias = torch.randn(n, generator=g)
            cases.append((torch.ops.baton.pack_q8p(w, int(qtype)), int(qtype), x, bias, w))
    torch.save(cases, tmp_path / "in.pt")
    proc = subprocess.run(
        [sys.executable, "-c", AVX2_RUN, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env={**os.environ, loader.ISA_ENV: "avx2"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, tiles, screened, path = torch.load(tmp_path / "out.pt")
    assert path == "avx2"
    assert all(tiles)  # linear_qp_tiles: the same dequantized values and GEMM as linear_q_tiles
    for (packed, qtype, x, bias, _), y, s in zip(cases, out["linear_qp"][0], screened, strict=True):
        kept = torch.isfinite(s)  # the screened head: linear_qp's bits where kept, its argmax
        assert torch.equal(s[kept], y[kept]) and torch.equal(s.argmax(-1), y.argmax(-1))
        if _built():
            bounds = torch.ops.baton.packed_row_bounds(packed, qtype)
            assert torch.equal(torch.ops.baton.linear_qp_argmax(x, packed, qtype, bias, bounds), s)
    for op, (ys, alone) in out.items():
        rows = iter(alone)
        for (packed, qtype, x, bias, w), y in zip(cases, ys, strict=True):
            if op == "linear_q8p":
                want = torch.ops.baton.linear_q8a(x, w, qtype, bias)
            else:
                want = torch.ops.baton.linear_q(x, w, qtype, bias)
            scale = want.abs().max().item()
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * scale)
            for i in range(x.shape[0]):
                assert torch.equal(next(rows), y[i]), (op, qtype, x.shape[0], i)
            if _built():  # the VNNI loop (or this same AVX2 loop): the same bits
                here = getattr(torch.ops.baton, op)(x, packed, qtype, bias)
                assert torch.equal(here, y), (op, qtype)


def _argmax_case(qtype: QType, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows of 48 tiles whose rows 5 and 700 repeat row 3 (exact ties for the first index
    to win), and x of ``rows`` rows: plain, heavy-tailed, zeros, huge values."""
    w = random_rows(768, 576, qtype, seed=seed)
    w[5] = w[3]
    w[700] = w[3]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 576, generator=g) * torch.randn(rows, 576, generator=g).exp()
    x[0] = torch.randn(576, generator=g)  # no outliers: the bound screens out most tiles
    if rows > 2:
        x[1] = 0.0  # every column 0, exactly (without a bias every tile stays)
        x[2] *= 1e30
    return torch.ops.baton.pack_q8p(w, int(qtype)), x


@needs_q8p
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 6, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_qp_argmax_keeps_linear_qp_where_a_row_can_peak(qtype, rows, with_bias):
    """x's first int8 piece screens the columns with a rigorous bound; every tile that can hold a
    row's largest value (ties included) gets linear_qp's bits, the rest -inf: the same argmax,
    first index on ties, and few tiles computed exactly."""
    packed, x = _argmax_case(qtype, rows, seed=rows)
    bounds = torch.ops.baton.packed_row_bounds(packed, int(qtype))
    assert bounds.shape == (48, 576 // 32, 16) and bool((bounds >= 0).all())
    bias = torch.randn(768, generator=torch.Generator().manual_seed(1)) if with_bias else None
    want = torch.ops.baton.linear_qp(x, packed, int(qtype), bias)
    got = torch.ops.baton.linear_qp_argmax(x, packed, int(qtype), bias, bounds)
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], want[kept])
    assert bool((got[~kept] == float("-inf")).all())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert bool(kept.view(rows, 48, 16).all(-1).eq(kept.view(rows, 48, 16).any(-1)).all())
    for m in range(rows):
        top = want[m] == want[m].max()
        assert bool(kept[m][top].all())  # every column tying the largest is exact
    if rows > 2 and bias is None:
        assert bool(kept[1].all())  # x = 0: nothing to tell the columns apart
    assert float(kept[0].float().mean()) < 0.5  # a plain row: most tiles screened out
    with torch_threads(1):
        assert torch.equal(
            torch.ops.baton.linear_qp_argmax(x, packed, int(qtype), bias, bounds), got
        )


@needs_q8p
def test_linear_qp_argmax_ties_and_nan():
    packed, _ = _argmax_case(QType.Q8_0, 1, seed=2)
    bounds = torch.ops.baton.packed_row_bounds(packed, int(QType.Q8_0))
    w = torch.ops.baton.dequantize_q8p_rows(packed, int(QType.Q8_0), torch.arange(768))
    x = w[3:4].clone()  # row 3 (and its copies 5 and 700) is the largest: a tie of three
    got = torch.ops.baton.linear_qp_argmax(x, packed, int(QType.Q8_0), None, bounds)
    want = torch.ops.baton.linear_qp(x, packed, int(QType.Q8_0))
    assert int(got.argmax()) == int(want.argmax()) == 3
    assert torch.equal(got[0, [3, 5, 700]], want[0, [3, 5, 700]])
    x[0, 7] = float("nan")  # NaN: no bound holds, every tile computed
    got = torch.ops.baton.linear_qp_argmax(x, packed, int(QType.Q8_0), None, bounds)
    assert torch.equal(got.isnan(), torch.ops.baton.linear_qp(x, packed, int(QType.Q8_0)).isnan())
    with pytest.raises(RuntimeError, match="packed_row_bounds"):
        torch.ops.baton.linear_qp_argmax(x, packed, int(QType.Q8_0), None, bounds[:-1])
