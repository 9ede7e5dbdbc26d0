"""The KVNamespace of a loaded model: what two engines must share for their KV blocks to match.

``build_namespace`` is called once per engine, in the engine process, from the model's folder
and the workers' KV-cache specs; the engine hands the same namespace to the scheduler half and
to every worker half, so both halves key blocks alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import msgspec

from baton.kv_transfer.types import KVNamespace
from baton.protocol import KVCacheSpec

#: Files whose names and sizes identify a model folder's weights (their contents are not read:
#: hashing gigabytes at every start would cost more than the cache saves).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
#: Small files whose contents identify the model's shapes and configuration.
CONFIG_FILES = ("config.json", "generation_config.json", "quantize_config.json")


def model_identity(folder: Path, variant: str = "") -> str:
    """``<resolved folder>@<digest>``: the digest covers the config files' bytes, each weight
    file's name and size, and ``variant`` (what the engine changes in the weights as it loads
    them: quantization, dtype)."""
    folder = folder.expanduser().resolve()
    h = hashlib.blake2b(variant.encode(), digest_size=16)
    if folder.is_file():  # a single .gguf
        h.update(f"{folder.name}:{folder.stat().st_size}".encode())
    else:
        for name in CONFIG_FILES:
            path = folder / name
            if path.is_file():
                h.update(name.encode() + b"\0" + path.read_bytes())
        for path in sorted(folder.iterdir()):
            if path.suffix in WEIGHT_SUFFIXES and path.is_file():
                h.update(f"\0{path.name}:{path.stat().st_size}".encode())
    return f"{folder}@{h.hexdigest()}"


def build_namespace(
    model: str, specs: Sequence[KVCacheSpec], tensor_parallel_size: int, pipeline_parallel_size: int
) -> KVNamespace:
    """The namespace of an engine whose workers (rank = pp_rank * tp + tp_rank) report ``specs``:
    the model's layers (summed over the pipeline's stages), its KV heads (summed over a stage's
    tensor-parallel shards) and ``key``, the hex digest of all of it."""
    if len(specs) != tensor_parallel_size * pipeline_parallel_size:
        raise ValueError(
            f"{len(specs)} KV-cache specs for tensor_parallel_size={tensor_parallel_size} x "
            f"pipeline_parallel_size={pipeline_parallel_size} workers"
        )
    first = specs[0]
    namespace = KVNamespace(
        model=model,
        kv_dtype=first.dtype,
        block_size=first.block_size,
        num_layers=sum(
            specs[p * tensor_parallel_size].num_layers for p in range(pipeline_parallel_size)
        ),
        num_kv_heads=sum(specs[t].num_kv_heads for t in range(tensor_parallel_size)),
        head_size=first.head_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    key = hashlib.blake2b(msgspec.msgpack.encode(namespace), digest_size=16).hexdigest()
    return msgspec.structs.replace(namespace, key=key)
