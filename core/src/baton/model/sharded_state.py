"""Checkpoints of an already sharded model: each rank saves and loads its own tensors.

``save_sharded_state`` writes every parameter and buffer of a rank's model as it runs
(after tensor-parallel sharding; non-persistent buffers such as rotary ``inv_freq``
included) to ``model-rank-{rank}-part-{part}.safetensors`` files, as vLLM's
ShardedStateLoader lays them out. A tensor reachable under several names (tied
embeddings) is stored once; the other names are kept as aliases in the file's metadata.
Rank 0's caller adds the model folder's non-weight files and ``MARKER`` (TP/PP sizes,
dtype, baton version). ``load_sharded_state`` puts a rank's tensors into a model built on
the meta device and sharded the same way (``model.load_format = "sharded_state"``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from baton.errors import ConfigError, InvalidRequestError, ModelLoadError

#: The file name pattern of vLLM's ShardedStateLoader.
DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
#: Written by rank 0's caller into a saved folder: the layout it was saved with.
MARKER = "baton-sharded-state.json"
#: Files of the model folder that are weights, never copied into a sharded folder.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_ALIASES_KEY = "baton_aliases"


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name (tied ones repeated), skipping meta shapes."""
    for name, t in model.named_parameters(remove_duplicate=False):
        yield name, t
    for name, t in model.named_buffers(remove_duplicate=False):
        if t is not None:
            yield name, t


def _group(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(canonical name -> tensor, alias -> canonical name): one entry per distinct tensor."""
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in _tensors(model):
        if t.device.type == "meta":
            continue  # a shape placeholder (a sharded LM head's full size), not data
        key = id(t)
        if key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        tensors[name] = t
    return tensors, aliases


def save_sharded_state(
    model: torch.nn.Module,
    folder: str | Path,
    rank: int,
    pattern: str | None = None,
    max_size: int | None = None,
) -> list[str]:
    """Write ``model``'s tensors for ``rank`` into ``folder``; the file names written.

    ``max_size`` (bytes) starts a new part when the next tensor would pass it.
    """
    from safetensors.torch import save_file

    pattern = pattern or DEFAULT_PATTERN
    if "{rank}" not in pattern or "{part}" not in pattern:
        raise InvalidRequestError(
            f"sharded-state file pattern {pattern!r}: it needs both {{rank}} and {{part}}, "
            f"e.g. {DEFAULT_PATTERN!r}",
            param="pattern",
        )
    if max_size is not None and max_size <= 0:
        raise InvalidRequestError(
            f"max_size {max_size!r}: give a positive number of bytes or None", param="max_size"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _group(model)
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_size is not None and parts[-1] and size + n > max_size:
            parts.append({})
            size = 0
        parts[-1][name] = t.detach().to("cpu").contiguous()
        size += n
    written = []
    for part, chunk in enumerate(parts):
        name = pattern.format(rank=rank, part=part)
        meta = {_ALIASES_KEY: json.dumps(aliases)} if part == 0 else {}
        save_file(chunk, str(folder / name), metadata=meta)
        written.append(name)
    return written


def write_folder_files(
    source: Path, folder: str | Path, tp_size: int, pp_size: int, dtype: str
) -> None:
    """Copy ``source``'s non-weight files (config, tokenizer, generation config) and write MARKER."""
    from baton import __version__

    folder = Path(folder)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != MARKER:
            if f.name.endswith(".index.json"):  # the full checkpoint's weight map
                continue
            shutil.copy2(f, folder / f.name)
    marker = {
        "tensor_parallel_size": tp_size,
        "pipeline_parallel_size": pp_size,
        "dtype": dtype,
        "baton_version": __version__,
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=1))


def check_marker(folder: Path, tp_size: int, pp_size: int) -> dict[str, Any]:
    """The folder's MARKER; ConfigError unless it was saved at ``tp_size`` x ``pp_size``."""
    path = folder / MARKER
    if not path.is_file():
        raise ConfigError(
            f"model.load_format='sharded_state' but {folder} has no {MARKER}: save one with "
            "LLM.save_sharded_state(path), or use load_format='auto' for a full checkpoint"
        )
    marker = json.loads(path.read_text())
    saved = (marker.get("tensor_parallel_size"), marker.get("pipeline_parallel_size"))
    if saved != (tp_size, pp_size):
        raise ConfigError(
            f"{folder} was saved with tensor_parallel_size={saved[0]}, "
            f"pipeline_parallel_size={saved[1]}, but the engine has tensor_parallel_size="
            f"{tp_size}, pipeline_parallel_size={pp_size}: start it with the saved sizes, or "
            "load the original model folder (load_format='auto') to reshard"
        )
    return marker


def load_sharded_state(model: torch.nn.Module, folder: Path, rank: int) -> None:
    """Fill ``model`` (built on meta, sharded as when saved) with ``rank``'s saved tensors.

    Every parameter and buffer must be in the files, and every stored tensor must fit a name
    in the model with the same shape (else ModelLoadError naming it); ties are restored.
    """
    from safetensors import safe_open

    files = sorted(folder.glob(f"model-rank-{rank}-part-*.safetensors"), key=_part_number)
    if not files:
        raise ModelLoadError(
            f"{folder} has no model-rank-{rank}-part-*.safetensors: was it saved with a custom "
            "pattern, or by fewer ranks?"
        )
    loaded: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            meta = st.metadata() or {}
            if _ALIASES_KEY in meta:
                aliases.update(json.loads(meta[_ALIASES_KEY]))
            for key in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                loaded[key] = st.get_tensor(key)
    names = dict(_tensors(model))
    missing = sorted(set(names) - set(loaded) - set(aliases))
    if missing:
        raise ModelLoadError(
            f"{folder} (rank {rank}) lacks {len(missing)} tensor(s) the model has, e.g. "
            f"{missing[:3]}: it was saved from another model or layout"
        )
    extra = sorted(set(loaded) - set(names))
    if extra:
        raise ModelLoadError(
            f"{folder} (rank {rank}) holds tensor(s) the model has not, e.g. {extra[:3]}: "
            "it was saved from another model or layout"
        )
    params: dict[str, torch.Tensor] = {}
    for name in names:
        canonical = aliases.get(name, name)
        value = loaded[canonical]
        if tuple(value.shape) != tuple(names[name].shape):
            raise ModelLoadError(
                f"{folder} (rank {rank}): {name!r} has shape {tuple(value.shape)}, the model "
                f"{tuple(names[name].shape)}"
            )
        _assign(model, name, value, params, canonical)
    for module in model.modules():  # rotary embeddings keep a plain-attribute copy
        inv = getattr(module, "original_inv_freq", None)
        if isinstance(inv, torch.Tensor) and inv.device.type == "meta":
            module.original_inv_freq = module.inv_freq.clone()


def _assign(
    model: torch.nn.Module,
    name: str,
    value: torch.Tensor,
    params: dict[str, torch.Tensor],
    canonical: str,
) -> None:
    parent, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if leaf in module._parameters:
        if canonical not in params:
            params[canonical] = torch.nn.Parameter(value, requires_grad=False)
        module._parameters[leaf] = params[canonical]
    else:
        module._buffers[leaf] = params.setdefault(canonical, value)


def _part_number(path: Path) -> int:
    return int(path.stem.rpartition("-part-")[2])
