"""The KV cache's element type: ``cache.dtype`` resolved against the model and the device."""

from __future__ import annotations

import torch

from baton.errors import ConfigError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_cache_dtype(setting: str, activation: torch.dtype, device: torch.device) -> torch.dtype:
    """The torch dtype of the KV cache for ``cache.dtype = setting``.

    "auto" is the activation dtype (the cache stores exactly what attention
    computes with). A narrower cache rounds keys/values on write; attention
    converts them back to the activation dtype when it reads them.
    """
    if setting == "auto":
        return activation
    dtype = _DTYPES.get(setting)
    if dtype is None:
        raise ConfigError(
            f"cache.dtype={setting!r} is not a KV cache dtype: use one of auto, {', '.join(_DTYPES)}"
        )
    if (
        dtype == torch.bfloat16
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError(
            f"cache.dtype='bfloat16' on {device}: this GPU has no native bfloat16; "
            "use cache.dtype='float16' (or 'auto')"
        )
    return dtype
