"""How big a block is and which shard of it a worker holds: the sizes both halves agree on."""

from __future__ import annotations

from baton.kv_transfer.types import KVNamespace

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def block_nbytes(namespace: KVNamespace) -> int:
    """Bytes of one block over all layers and heads (every worker's shard together): the unit
    both halves count the RAM tier's capacity in, so their accounting is the same."""
    itemsize = _ITEMSIZE.get(namespace.kv_dtype.removeprefix("torch."))
    if itemsize is None:
        raise ValueError(f"KV dtype {namespace.kv_dtype!r} has no known element size")
    per_token = 2 * namespace.num_layers * namespace.num_kv_heads * namespace.head_size
    return per_token * namespace.block_size * itemsize


def shard_key(namespace: KVNamespace, tp_rank: int, pp_rank: int) -> str:
    """The key of one worker's blocks: the namespace's key and the worker's shard, so a block
    file is only ever read by the same model, dtype, block size, layout and shard."""
    if not namespace.key:
        raise ValueError(
            f"KVNamespace of {namespace.model!r} has no key: build it with "
            "baton.kv_transfer.namespace"
        )
    return f"{namespace.key}-tp{tp_rank}-pp{pp_rank}"


def shard_keys(namespace: KVNamespace) -> list[str]:
    """Every worker's shard key (all must hold a block for the engine to load it)."""
    return [
        shard_key(namespace, tp, pp)
        for pp in range(namespace.pipeline_parallel_size)
        for tp in range(namespace.tensor_parallel_size)
    ]
