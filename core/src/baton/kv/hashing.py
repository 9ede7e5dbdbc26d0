"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its own token ids and any extra
keys that change the KV it holds (``Request.cache_salt``, and the LoRA adapter the
request runs with: its id and the engine's registration of that id, ``Request.lora_key``):
two blocks with the same tokens after different prefixes never share a hash, and
requests with different salts or adapters never share KV. Hashes are 16-byte blake2b digests over a
compact encoding (``array('q').tobytes()``), stable across processes and runs
(unlike Python's ``hash()``).

They are computed incrementally: once per block, when it becomes full, and
appended to ``Request.block_hashes`` (``update_block_hashes``). Nothing re-hashes
per step.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.request import Request

BlockHash = bytes

#: The parent of a request's first block when it has no cache salt.
ROOT_HASH: BlockHash = b"\x00" * 16


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """The hash of one full block: parent hash + its token ids + extra keys."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


def root_hash(cache_salt: str | None, lora_key: str | None = None) -> BlockHash:
    """The parent of a request's first block; the salt and the LoRA adapter's key (if any) go in
    here and so into every block."""
    if cache_salt is None and lora_key is None:
        return ROOT_HASH
    extra = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    if lora_key is not None:
        extra += b"\x00lora:" + lora_key.encode()
    return hash_block(ROOT_HASH, (), extra)


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append the hashes of the request's blocks that became full since the last call."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    n = len(hashes)
    num_full = len(tokens) // block_size
    if n >= num_full:
        return
    parent = hashes[-1] if n else root_hash(request.cache_salt, request.lora_key)
    for i in range(n, num_full):
        start = i * block_size
        parent = hash_block(parent, tokens[start : start + block_size])
        hashes.append(parent)
