"""The dtype a model loads and computes in, from ``model.dtype``, the checkpoint and the device.

On CPU a 16-bit dtype is only worth it where the CPU computes it natively
(``baton.kernels.cpu_features``); elsewhere torch emulates it through float32
around every op, and baton's C++ kernels and fast decode (float32 only) are off:

- ``auto``: the checkpoint's bfloat16 / float16 where native, else float32
  (the 16-bit weights are upcast once at load; an info log says why). Always
  float32 with ``model.quantization = "int8"/"int4"`` (their layers compute in
  float32).
- ``bfloat16`` / ``float16`` set explicitly: run as asked; where emulated, a
  warning (once per process) gives the measured cost and the fix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from baton.kernels import cpu_features

log = logging.getLogger(__name__)

#: Per-token decode time of emulated 16-bit types over float32 (baton's kernels and fast
#: decode included), SmolLM2-135M, model.quantization=none, executor.num_threads=2, on an AMD
#: EPYC with avx2 fma f16c and no avx512_bf16 / avx512_fp16 / AMX (2026-12-02, a loaded host):
#: the engines interleaved over 3 rounds, float32 342 ms, bfloat16 1593 ms, float16 1758 ms;
#: ``baton bench latency`` run one after the other: float32 762 ms, bfloat16 4762 ms (6.3x).
EMULATED_SLOWDOWN: dict[torch.dtype, float] = {torch.bfloat16: 4.7, torch.float16: 5.1}
_warned: set[torch.dtype] = set()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The checkpoint's own float dtype (config ``dtype`` / ``torch_dtype``); float32 if unstated."""
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if dt in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def resolve_dtype(
    name: str, hf_config: Any, device: torch.device, quantization: str = "none"
) -> torch.dtype:
    """The torch dtype for ``model.dtype = name`` (see the module docstring); logs the choice."""
    if name != "auto":
        dtype: torch.dtype = getattr(torch, name)
        if device.type == "cpu":
            _warn_emulated(dtype)
        return dtype
    own = checkpoint_dtype(hf_config)
    if device.type != "cpu" or own == torch.float32:
        return own
    if quantization in ("int8", "int4"):
        log.info(
            "model.dtype=auto: float32, not the checkpoint's %s: model.quantization=%s "
            "layers compute in float32",
            dtype_name(own),
            quantization,
        )
        return torch.float32
    features = cpu_features.cpu_features()
    if features.native(own):
        log.info(
            "model.dtype=auto: %s as the checkpoint stores it, native on this CPU, %s",
            dtype_name(own),
            features.describe(),
        )
        return own
    log.info(
        "model.dtype=auto: the checkpoint's %s weights are upcast once to float32 at load: this "
        "CPU, %s, has no native %s arithmetic and emulates it %s (set model.dtype = %r to run "
        "in it anyway)",
        dtype_name(own),
        features.describe(),
        dtype_name(own),
        _cost(own),
        dtype_name(own),
    )
    return torch.float32


def _cost(dtype: torch.dtype) -> str:
    factor = EMULATED_SLOWDOWN.get(dtype, 0.0)
    if not factor:
        return "through float32"
    return (
        f"through float32: {factor:.1f}x the float32 time per decode token, measured on "
        "SmolLM2-135M on an AVX2 CPU"
    )


def _warn_emulated(dtype: torch.dtype) -> None:
    """Warn once per process per dtype when the CPU has to emulate ``dtype``."""
    features = cpu_features.cpu_features()
    if features.native(dtype) or dtype in _warned:
        return
    _warned.add(dtype)
    log.warning(
        "model.dtype=%s on a CPU without native %s arithmetic, %s: torch emulates it %s, and "
        "baton's float32 kernels and fast decode are off; it halves weight memory only. Set "
        'model.dtype = "float32" (or "auto") for speed',
        dtype_name(dtype),
        dtype_name(dtype),
        features.describe(),
        _cost(dtype),
    )
