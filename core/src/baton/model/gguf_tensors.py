"""A GGUF file's tensors as stored, matched to the modules of the model converted from it.

``convert_gguf`` dequantises a GGUF once into a float32 Hugging Face folder and
records the source file in the folder's marker. To keep a GGUF's quantized
tensors as they are, the loader reads them again from that source (memory-mapped;
the file's index is parsed here, type sizes and names come from gguf-py) and
needs, for each module of the loaded model, the
GGUF tensor it came from: gguf-py's own name map does that for every
architecture it knows (``model.layers.3.mlp.down_proj`` -> ``blk.3.ffn_down``).

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of "llama"
files (rotary halves interleaved per head), and transformers' GGUF loader
permutes them back. Quantization blocks run along a row, so the same
permutation applied to whole rows of the raw blocks gives the tensor
transformers saw, still quantized.
"""

from __future__ import annotations

import logging
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from baton.errors import ModelLoadError
from baton.model.gguf_cache import read_marker

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
    marker = read_marker(folder)
    if marker is None:
        return None
    source = marker.source
    try:
        unchanged = marker.names(source)
    except OSError:
        log.warning(
            "%s was converted from %s, which is gone: its weights stay dequantized", folder, source
        )
        return None
    if not unchanged:
        log.warning(
            "%s changed since it was converted into %s: its weights stay dequantized "
            "(delete the folder to convert it again)",
            source,
            folder,
        )
        return None
    return source


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies in a GGUF file: ggml type id, dimensions (innermost first), byte offset."""

    type_id: int
    dims: tuple[int, ...]
    offset: int


#: GGUF metadata value types (gguf.md): fixed sizes; 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
#: Data alignment when the file does not set general.alignment.
DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Reads little-endian GGUF values from a buffer, front to back."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        """The value of type ``vtype``: scalars and strings decoded, arrays skipped (None)."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALAR_SIZES:
                self.pos += count * _SCALAR_SIZES[etype]
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        size = _SCALAR_SIZES.get(vtype)
        if size is None:
            raise ValueError(f"unknown metadata value type {vtype} at byte {self.pos}")
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size]
        (v,) = self.unpack(fmt)
        return v


def read_index(buf: Any) -> tuple[dict[str, Any], dict[str, TensorInfo], int]:
    """(scalar metadata, tensor infos by name, start of the data section) of a GGUF file's bytes.

    The layout of gguf.md (versions 2 and 3): header, key/value metadata, tensor infos,
    then the tensors' data, aligned. Written here because gguf-py's GGUFReader decodes
    every metadata array element into numpy views (seconds for a 49k-token vocabulary).
    """
    c = _Cursor(buf)
    magic, version, n_tensors, n_kv = c.unpack("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        (vtype,) = c.unpack("<I")
        meta[key] = c.value(vtype)
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name = c.string()
        (n_dims,) = c.unpack("<I")
        dims = c.unpack(f"<{n_dims}Q")
        type_id, offset = c.unpack("<IQ")
        tensors[name] = TensorInfo(type_id, tuple(dims), offset)
    align = meta.get("general.alignment") or DEFAULT_ALIGNMENT
    return meta, tensors, -(-c.pos // align) * align


class GGUFTensors:
    """The tensors of one GGUF file by name; ``close()`` closes the file.

    The index is parsed from a memory map that is closed at once; tensors are read
    with plain file reads, so the file's pages are not mapped into the process (they
    would count in its resident memory while mapped).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file: BinaryIO | None = path.open("rb")
            with mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                meta, self._tensors, self._data = read_index(mm)
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"cannot read the GGUF file {str(path)!r}: {e}") from e
        arch = meta.get("general.architecture")
        self.architecture: str = arch if isinstance(arch, str) else ""

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def type_id(self, name: str) -> int:
        return self._tensors[name].type_id

    def read(self, name: str, row_order: torch.Tensor | None = None) -> RawTensor:
        """Tensor ``name`` read as uint8 rows (in ``row_order`` when given).

        The shape is the PyTorch one, (rows, columns): GGUF lists dimensions innermost first.
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self._file is None:
            raise ModelLoadError(f"{self.path}: read {name!r} after close()")
        info = self._tensors[name]
        cols = info.dims[0]
        rows = int(np.prod(info.dims[1:])) if len(info.dims) > 1 else 1
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
        data = np.empty((rows, cols // block * size), dtype=np.uint8)
        self._file.seek(self._data + info.offset)
        if self._file.readinto(memoryview(data).cast("B")) != data.nbytes:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} runs past the end of the file; re-download it"
            )
        if row_order is not None:
            data = data[row_order.numpy()]
        return RawTensor(name, torch.from_numpy(data), info.type_id, (rows, cols))


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
