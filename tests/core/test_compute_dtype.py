"""Native bf16/fp16 detection (``cpu_features``) and the dtype ``model.dtype`` resolves to
(``compute_dtype``), with the detection patched both ways."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from baton.kernels import cpu_features
from baton.kernels.cpu_features import features_from, native_compute, read_flags
from baton.model import compute_dtype
from baton.model.compute_dtype import resolve_dtype

CPU = torch.device("cpu")
AVX2 = frozenset({"avx2", "fma", "f16c"})
BF16_CKPT = SimpleNamespace(dtype="bfloat16")


@pytest.fixture
def cpu(monkeypatch):
    """Set the detected CPU: ``cpu(flags, arch="x86_64")``; warnings start unsent."""
    monkeypatch.setattr(compute_dtype, "_warned", set())

    def set_cpu(flags: frozenset[str], arch: str = "x86_64") -> None:
        features = features_from(arch, flags)
        monkeypatch.setattr(cpu_features, "cpu_features", lambda: features)

    return set_cpu


@pytest.mark.parametrize(
    ("arch", "flags", "bf16", "fp16"),
    [
        ("x86_64", AVX2, False, False),
        ("x86_64", AVX2 | {"avx512f", "avx512_bf16"}, True, False),
        ("x86_64", AVX2 | {"amx_tile", "amx_bf16"}, True, False),
        ("AMD64", AVX2 | {"avx512_fp16", "amx_bf16"}, True, True),
        ("aarch64", frozenset({"asimd", "asimdhp", "bf16"}), True, True),
        ("arm64", frozenset({"asimd"}), False, False),
        ("riscv64", frozenset({"bf16"}), False, False),  # no table: never taken as native
    ],
)
def test_features_from_flags(arch, flags, bf16, fp16):
    f = features_from(arch, flags)
    assert (f.bf16, f.fp16) == (bf16, fp16)
    assert f.native(torch.bfloat16) is bf16 and f.native(torch.float16) is fp16
    assert f.native(torch.float32)


def test_describe_quotes_the_flags_that_matter():
    assert features_from("x86_64", AVX2 | {"sse2"}).describe() == (
        "x86_64 (avx2 f16c fma no native bf16/fp16 flag)"
    )
    assert "avx512_bf16" in features_from("x86_64", AVX2 | {"avx512_bf16"}).describe()


def test_read_flags_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    )
    assert read_flags(x86) == {"fpu", "avx2", "avx512_bf16"}  # the first CPU's
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd asimdhp bf16\n")
    assert read_flags(arm) == {"fp", "asimd", "asimdhp", "bf16"}
    assert read_flags(tmp_path / "missing") == frozenset()


def test_this_machine_is_detected():
    f = cpu_features.cpu_features()
    assert f.arch and f.native(torch.float32)
    assert native_compute(torch.bfloat16, CPU) is f.bf16


def test_auto_keeps_a_bf16_checkpoint_where_native(cpu, caplog):
    cpu(AVX2 | {"avx512_bf16"})
    with caplog.at_level(logging.INFO, "baton.model.compute_dtype"):
        assert resolve_dtype("auto", BF16_CKPT, CPU) == torch.bfloat16
    assert "bfloat16 as the checkpoint stores it, native on this CPU" in caplog.text
    assert "avx512_bf16" in caplog.text


def test_auto_upcasts_a_bf16_checkpoint_where_emulated(cpu, caplog):
    cpu(AVX2)
    with caplog.at_level(logging.INFO, "baton.model.compute_dtype"):
        assert resolve_dtype("auto", BF16_CKPT, CPU) == torch.float32
    assert "weights are upcast once to float32 at load" in caplog.text
    assert "no native bfloat16 arithmetic" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_auto_float16_follows_the_fp16_flags(cpu):
    ckpt = SimpleNamespace(torch_dtype=torch.float16)  # older configs: torch_dtype, a torch dtype
    cpu(frozenset({"asimd", "asimdhp"}), arch="aarch64")
    assert resolve_dtype("auto", ckpt, CPU) == torch.float16
    cpu(frozenset({"asimd", "bf16"}), arch="aarch64")
    assert resolve_dtype("auto", ckpt, CPU) == torch.float32


def test_auto_is_float32_for_float32_checkpoints_and_int_quantization(cpu):
    cpu(AVX2 | {"avx512_bf16"})
    assert resolve_dtype("auto", SimpleNamespace(dtype="float32"), CPU) == torch.float32
    assert resolve_dtype("auto", SimpleNamespace(), CPU) == torch.float32  # unstated
    for mode in ("int8", "int4"):  # their layers compute in float32
        assert resolve_dtype("auto", BF16_CKPT, CPU, mode) == torch.float32


def test_auto_on_cuda_takes_the_checkpoint_dtype(cpu):
    cpu(AVX2)  # the CPU's flags do not matter there
    assert resolve_dtype("auto", BF16_CKPT, torch.device("cuda")) == torch.bfloat16


def test_explicit_bf16_runs_as_asked_and_warns_once_where_emulated(cpu, caplog):
    cpu(AVX2)
    with caplog.at_level(logging.INFO, "baton.model.compute_dtype"):
        assert resolve_dtype("bfloat16", BF16_CKPT, CPU) == torch.bfloat16
        assert resolve_dtype("bfloat16", SimpleNamespace(dtype="float32"), CPU) == torch.bfloat16
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "without native bfloat16 arithmetic" in msg and "avx2" in msg
    assert 'model.dtype = "float32" (or "auto")' in msg


def test_explicit_bf16_where_native_does_not_warn(cpu, caplog):
    cpu(AVX2 | {"amx_bf16"})
    with caplog.at_level(logging.INFO, "baton.model.compute_dtype"):
        assert resolve_dtype("bfloat16", BF16_CKPT, CPU) == torch.bfloat16
        assert resolve_dtype("float32", BF16_CKPT, CPU) == torch.float32
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
