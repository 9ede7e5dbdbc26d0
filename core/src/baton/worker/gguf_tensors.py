"""A GGUF file's tensors as stored, matched to the modules of the model converted from it.

``convert_gguf`` dequantises a GGUF once into a float32 Hugging Face folder and
records the source file in the folder's marker. To keep a GGUF's quantized
tensors as they are, the loader reads them again from that source (memory-mapped
with ``gguf.GGUFReader``) and needs, for each module of the loaded model, the
GGUF tensor it came from: gguf-py's own name map does that for every
architecture it knows (``model.layers.3.mlp.down_proj`` -> ``blk.3.ffn_down``).

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of "llama"
files (rotary halves interleaved per head), and transformers' GGUF loader
permutes them back. Quantization blocks run along a row, so the same
permutation applied to whole rows of the raw blocks gives the tensor
transformers saw, still quantized.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from baton.errors import ModelLoadError
from baton.worker.model_loader import MARKER

log = logging.getLogger(__name__)

#: The embedding's tensor, which also serves as the LM head when a file has no ``output`` tensor.
TOKEN_EMBD = "token_embd.weight"
#: GGUF architectures whose attn_q/attn_k rows transformers un-permutes on load (its LlamaTensorProcessor).
PERMUTED_QK_ARCHS = frozenset({"llama"})


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor's bytes as stored: ``raw`` [rows, row bytes] uint8, ggml type id, (rows, cols)."""

    name: str
    raw: torch.Tensor
    type_id: int
    shape: tuple[int, int]


def gguf_source(folder: Path) -> Path | None:
    """The .gguf a converted folder was made from; None when ``folder`` is not a conversion.

    None too (with a warning) when the source file is gone or changed since: its
    tensors might no longer be the ones the folder holds.
    """
    marker = folder / MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
        source = Path(info["source"])
        size, mtime = int(info["size"]), int(info["mtime"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"{marker} is unreadable ({type(e).__name__}: {e}); delete {folder} to convert again"
        ) from None
    try:
        st = source.stat()
    except OSError:
        log.warning(
            "%s was converted from %s, which is gone: its weights stay dequantized", folder, source
        )
        return None
    if (st.st_size, int(st.st_mtime)) != (size, mtime):
        log.warning(
            "%s changed since it was converted into %s: its weights stay dequantized "
            "(delete the folder to convert it again)",
            source,
            folder,
        )
        return None
    return source


class GGUFTensors:
    """The tensors of one GGUF file, memory-mapped, by name; ``close()`` unmaps the file."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        try:
            self._reader: Any = GGUFReader(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read the GGUF file {str(path)!r}: {e}") from e
        self.path = path
        self._tensors = {t.name: t for t in self._reader.tensors}
        field = self._reader.fields.get("general.architecture")
        self.architecture: str = field.contents() if field is not None else ""

    def close(self) -> None:
        """Drop the reader: its memory map goes once no tensor view of it is left."""
        self._tensors.clear()
        self._reader = None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def type_id(self, name: str) -> int:
        return int(self._tensors[name].tensor_type)

    def read(self, name: str, row_order: torch.Tensor | None = None) -> RawTensor:
        """Tensor ``name`` copied out of the map as uint8 rows (in ``row_order`` when given).

        The shape is the PyTorch one, (rows, columns): GGUF lists dimensions innermost first.
        """
        t = self._tensors[name]
        cols, rows = (int(d) for d in t.shape[:2]) if len(t.shape) >= 2 else (int(t.shape[0]), 1)
        data = t.data
        if data.dtype != np.uint8:  # a float tensor: its bytes, one row per row
            data = data.reshape(rows, -1).view(np.uint8)
        if row_order is not None:
            data = data[row_order.numpy()]  # fancy indexing copies
        raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True).reshape(rows, -1))
        return RawTensor(name, raw, int(t.tensor_type), (rows, cols))


def tensor_name_map(architecture: str, num_layers: int) -> Any:
    """gguf-py's HF -> GGUF name map for ``architecture``; None when gguf-py does not know it."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == architecture), None)
    return None if arch is None else get_tensor_name_map(arch, num_layers)


def gguf_tensor_name(name_map: Any, module_name: str) -> str | None:
    """The GGUF tensor (``blk.3.ffn_down.weight``) of a module (``model.layers.3.mlp.down_proj``)."""
    base = name_map.get_name(module_name)
    return None if base is None else f"{base}.weight"


def qk_row_order(
    tensor_name: str, rows: int, architecture: str, hf_config: Any
) -> torch.Tensor | None:
    """The row order that undoes llama.cpp's q/k permutation of ``tensor_name``; None if none applies.

    Row ``r`` of the result is row ``order[r]`` of the GGUF tensor: transformers'
    ``_reverse_permute_weights`` applied to row indices.
    """
    if architecture not in PERMUTED_QK_ARCHS:
        return None
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    if heads is None or kv_heads is None:  # transformers leaves the rows as they are then
        return None
    if ".attn_q." in tensor_name:
        n_head = heads
    elif ".attn_k." in tensor_name:
        n_head = kv_heads
    else:
        return None
    if rows % (2 * n_head):
        raise ModelLoadError(
            f"{tensor_name}: {rows} rows do not split into {n_head} heads of rotary pairs"
        )
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(rows)
