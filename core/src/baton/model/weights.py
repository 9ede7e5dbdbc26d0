"""Build a model's torch module and fill it with its weights: ``from_pretrained`` with baton's
attention, ``prepare`` (a parallel rank's sharding), quantization at load
(``baton.model.quantization``) or this rank's slice of a sharded state
(``baton.model.sharded_state``). Finding and converting the model is ``baton.model.loader``'s;
it stays free of torch for the engine core and the CLI.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from baton.errors import ConfigError, ModelLoadError
from baton.kernels import attention
from baton.model.compute_dtype import resolve_dtype
from baton.model.loader import check_architecture, load_hf_config
from baton.model.quantization import quantize_model
from baton.model.sharded_state import check_marker, load_sharded_state
from baton.parallel.context import get_parallel_context

if TYPE_CHECKING:
    from baton.config import ExecutorSection, ModelSection

# the loader's name, as before this module was cut from it: log filters keep working
log = logging.getLogger("baton.model.loader")


#: One from_pretrained at a time per process: it builds the model under accelerate's
#: init_empty_weights, which patches torch.nn.Module globally, so two engine cores loading on
#: threads of one process (data parallel with the in-process transport) would see each other's
#: meta tensors.
_FROM_PRETRAINED = threading.Lock()


def load_model(
    settings: ModelSection,
    executor: ExecutorSection,
    device: torch.device,
    dtype: torch.dtype | None = None,
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """Load ``settings.name`` onto ``device`` with attn_implementation="baton", in eval mode.

    ``prepare(model)`` runs on the loaded model before it moves to ``device``
    (tensor- and pipeline-parallel workers shard or prune it there, so only
    their part ever reaches the device); ``model.quantization`` applies after it
    (``baton.model.quantization``). ``executor``: the parallel sizes and kernels.
    """
    folder, hf_config = load_hf_config(settings)
    cls = check_architecture(hf_config)
    dtype = dtype or resolve_dtype(settings.dtype, hf_config, device, settings.quantization)
    attention.register()
    t0 = time.monotonic()
    if settings.load_format == "sharded_state":
        model = _load_sharded(settings, executor, folder, hf_config, cls, dtype, prepare)
        model.to(device)
        model.eval()
        model.requires_grad_(False)
        log.info("loaded %s's sharded state on %s in %.1f s", folder, device, time.monotonic() - t0)
        return model
    try:
        with _FROM_PRETRAINED:
            model = cls.from_pretrained(
                folder, dtype=dtype, attn_implementation=attention.ATTN_IMPL
            )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the model in {folder}: {e}") from e
    if prepare is not None:
        prepare(model)
    quantize_model(model, settings, executor, folder, device, dtype)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    log.info(
        "loaded %s (%s, %.1f MiB of weights, %s activations) on %s in %.1f s",
        settings.name,
        type(model).__name__,
        weight_bytes(model) / 2**20,
        str(dtype).removeprefix("torch."),
        device,
        time.monotonic() - t0,
    )
    return model


def _load_sharded(
    settings: ModelSection,
    executor: ExecutorSection,
    folder: Path,
    hf_config: Any,
    cls: Any,
    dtype: torch.dtype,
    prepare: Callable[[torch.nn.Module], None] | None,
) -> torch.nn.Module:
    """The model built on meta from its config, prepared (sharded) as at save, then filled with
    this rank's tensors from ``folder`` (``baton.model.sharded_state``); no full weights read."""
    tp, pp = executor.tensor_parallel_size, executor.pipeline_parallel_size
    check_marker(folder, tp, pp)
    if settings.quantization in ("int8", "int4"):
        raise ConfigError(
            f"model.quantization={settings.quantization!r} with load_format='sharded_state': "
            "a sharded state holds float weights as saved; use quantization 'auto' or 'none'"
        )
    rank = 0
    if tp * pp > 1:
        rank = get_parallel_context().rank
    with torch.device("meta"):
        model = cls._from_config(hf_config, dtype=dtype, attn_implementation=attention.ATTN_IMPL)
    if prepare is not None:
        prepare(model)
    load_sharded_state(model, folder, rank)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, and of the quantized layers' packed rows
    (QuantLinear.packed, not a buffer), each storage counted once (tied weights once)."""
    seen: set[int] = set()
    total = 0
    packed = [
        m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)
    ]
    for t in (*model.parameters(), *model.buffers(), *packed):
        if t.device.type == "meta":  # a shape placeholder (a sharded LM head's full size)
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
