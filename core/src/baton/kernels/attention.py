"""baton's paged attention, plugged into transformers through its AttentionInterface.

The runner flattens every scheduled token of a step into one sequence (batch
dimension 1, explicit ``position_ids``) and passes an ``AttentionMetadata`` as
the forward keyword argument ``baton_attn``; transformers hands it, untouched,
to ``paged_attention`` in every layer. There the new keys/values are written
into the paged cache by slot (``slot = block_id * block_size + offset``), then
each request attends over its own blocks:

- decode tokens (one query per request) come first in the flattened sequence,
  in groups (one group when the C++ kernels run; otherwise groups of similar
  context length, whose blocks are padded to the group's longest);
- prefill chunks (a prompt, or a chunk after a cached prefix) are attended one
  request at a time with ``scaled_dot_product_attention``.

GQA is never expanded in memory: decode folds the query heads of one KV head
into a matrix; prefill uses SDPA's ``enable_gqa``.

Cache layout per layer: a ``[2, num_blocks, kv_heads, block_size, head_dim]``
allocation whose K half holds each block's keys transposed, ``[head_dim,
block_size]`` (``key_cache_view``): the scores of a block's tokens are then one
matmul (torch) or vertical FMAs (C++) without transposing anything. V blocks
are ``[block_size, head_dim]``. A block may hold slots past a request's context;
they are masked out, and the cache is zero-initialised so that they are always
finite (0 * NaN would poison the output).

Two implementations of the cache writes and of decode:

- ``meta.kernels`` (CPU, the C++ kernels built; ``baton.kernels``):
  ``torch.ops.baton.paged_write`` and ``paged_decode``, which reads each
  request's blocks in place, once; they compute in float32, so bfloat16/float16
  queries, keys and values are widened on the way in and outputs rounded back;
- torch ops everywhere else (CUDA, other dtypes, no compiler): index_put writes;
  decode gathers whole blocks along the first dimension (one contiguous copy per
  block: 2.2x faster than gathering along an inner dimension) and attends block
  by block in batched matmuls.

The cache may be narrower than the activations (``cache.dtype``: float16 or
bfloat16 under float32 activations). Writes round to it (nearest even, in both
implementations); reads convert gathered blocks back to the query's dtype. A
prefill attends over its own fresh keys/values rounded the same way, so a
request's tokens do not depend on whether its prefix came from the cache or from
an earlier chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTN_IMPL = "baton"
#: The forward keyword argument that carries the step's metadata to every layer.
META_KWARG = "baton_attn"


@dataclass
class DecodeGroup:
    """Decode tokens ``[start, start + n)`` of the flattened sequence, padded to ``max_len`` keys."""

    start: int
    n: int
    max_len: int  # keys per request after the gather: blocks_per_req * block_size
    #: [n * blocks_per_req] int64: each request's blocks, padded with its last one
    blocks: torch.Tensor
    ctx_lens: torch.Tensor  # [n] int64: number of keys of each request (position + 1)
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """Additive mask [n, 1, max_len]: 0 where a key is visible, -inf elsewhere."""
        m = self._masks.get(window)
        if m is None:
            pos = torch.arange(self.max_len, device=self.blocks.device)
            ok = pos[None, :] < self.ctx_lens[:, None]
            if window is not None:  # transformers: key visible iff q - k < window
                ok &= pos[None, :] > (self.ctx_lens[:, None] - 1 - window)
            m = torch.zeros(ok.shape, dtype=torch.float32, device=ok.device)
            m.masked_fill_(~ok, float("-inf"))
            m = m.unsqueeze(1)
            self._masks[window] = m
        return m


@dataclass
class PrefillSeq:
    """Query tokens ``[start, start + q_len)`` of one request, whose first ``prefix_len`` keys are cached."""

    start: int
    q_len: int
    prefix_len: int
    #: The blocks holding all ``prefix_len + q_len`` keys; None when prefix_len == 0 (the fresh keys suffice).
    blocks: torch.Tensor | None
    _masks: dict[tuple[int | None, bool], torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, causal: bool, device: torch.device) -> torch.Tensor | None:
        """Boolean mask [q_len, prefix_len + q_len] (True = visible), or None for plain causal."""
        key = (window, causal)
        if key in self._masks:
            return self._masks[key]
        s = self.prefix_len + self.q_len
        if causal and window is None and self.prefix_len == 0:
            m = None  # SDPA's is_causal
        else:
            q_pos = torch.arange(self.prefix_len, s, device=device)[:, None]
            k_pos = torch.arange(s, device=device)[None, :]
            m = (
                k_pos <= q_pos
                if causal
                else torch.ones(self.q_len, s, dtype=torch.bool, device=device)
            )
            if window is not None:
                m = m & (k_pos > q_pos - window)
        self._masks[key] = m
        return m


@dataclass
class AttentionMetadata:
    """What every layer needs for one step; built once per step by the model runner."""

    #: Per layer index: the layer's cache [2, num_blocks, kv_heads, block_size, head_dim], or None
    #: (no cache: a profiling run of one causal sequence).
    kv_caches: list[torch.Tensor | None] | None
    slot_mapping: torch.Tensor | None  # [num_tokens] int64: block_id * block_size + offset
    block_size: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    num_tokens: int
    #: Reused by every layer for its output (each layer's o_proj reads it before the next layer
    #: writes): a fresh multi-MB tensor per layer costs page faults on CPU. None: allocate.
    out: torch.Tensor | None = None
    #: Cache writes and decode through baton's C++ CPU kernels (CPU; 16-bit activations widened).
    kernels: bool = False
    #: slot_mapping split into (block, offset), once per step for every layer's writes.
    slot_blocks: torch.Tensor | None = field(init=False, default=None)
    slot_offsets: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.slot_mapping is not None and not self.kernels:
            self.slot_blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
            self.slot_offsets = self.slot_mapping - self.slot_blocks * self.block_size


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    meta: AttentionMetadata | None = kwargs.get(META_KWARG)
    if meta is None:
        raise RuntimeError(
            f"baton attention called without {META_KWARG}=...: the model's forward did not pass "
            "extra keyword arguments through to its attention layers"
        )
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError(
            "baton attention supports neither attention sinks nor logit soft-capping"
        )
    window = kwargs.get("sliding_window")
    causal = getattr(module, "is_causal", True)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if meta.out is not None and meta.out.numel() >= num_tokens * num_heads * head_dim:
        out = meta.out.view(-1)[: num_tokens * num_heads * head_dim].view(
            1, num_tokens, num_heads, head_dim
        )
    else:
        out = query.new_empty(1, num_tokens, num_heads, head_dim)

    cache = meta.kv_caches[module.layer_idx] if meta.kv_caches is not None else None
    if cache is None:  # profiling run: one causal sequence, nothing cached
        o = F.scaled_dot_product_attention(
            query, key, value, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[0] = o[0].transpose(0, 1)
        return out, None

    k_cache, v_cache = key_cache_view(cache), cache[1]
    if meta.kernels:
        _kernel_write_and_decode(query, key, value, k_cache, v_cache, meta, window, scale, out)
    else:
        # index_put by (block, offset): [T, kv_heads, head_dim] (index_copy_ is ~30x slower on CPU);
        # .to() rounds to a narrower cache dtype to nearest even, as paged_write does
        blocks, offsets = meta.slot_blocks, meta.slot_offsets
        k_cache[blocks, :, :, offsets] = key[0].transpose(0, 1).to(k_cache.dtype)
        v_cache[blocks, :, offsets] = value[0].transpose(0, 1).to(v_cache.dtype)
        group = num_heads // num_kv_heads
        for g in meta.decode_groups:
            _decode(query, k_cache, v_cache, g, window, scale, group, out)
    for p in meta.prefills:
        _prefill(query, key, value, k_cache, v_cache, p, window, causal, scale, out)
    return out, None


def _kernel_write_and_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The step's cache writes and decodes through the C++ kernels, which take float32: 16-bit
    activations are widened (exact; the writes round back to the cache dtype to nearest even,
    as .to() does) and each decode's float32 output is rounded into ``out``."""
    wide = query.dtype is not torch.float32
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if wide:
        k, v = k.float(), v.float()
    torch.ops.baton.paged_write(k, v, k_cache, v_cache, meta.slot_mapping)
    for g in meta.decode_groups:
        q = query[0, :, g.start : g.start + g.n].transpose(0, 1)
        o = out[0, g.start : g.start + g.n]
        o32 = torch.empty(o.shape) if wide else o
        torch.ops.baton.paged_decode(
            q.float() if wide else q,
            k_cache,
            v_cache,
            g.blocks.view(g.n, -1),
            g.ctx_lens,
            window or 0,
            scale,
            o32,
        )
        if wide:
            o.copy_(o32)


def key_cache_view(cache: torch.Tensor) -> torch.Tensor:
    """The K half of a layer's cache as it is stored: [num_blocks, kv_heads, head_dim, block_size]."""
    _, num_blocks, kv_heads, block_size, head_dim = cache.shape
    return cache[0].view(num_blocks, kv_heads, head_dim, block_size)


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: DecodeGroup,
    window: int | None,
    scale: float,
    group: int,
    out: torch.Tensor,
) -> None:
    _, kvh, d, bs = k_cache.shape
    n, nb = g.n, g.max_len // bs
    # [H, n, D] -> [n, 1, KVH, G, D]: the G query heads sharing a KV head form one matrix,
    # broadcast over the request's blocks.
    q = query[0, :, g.start : g.start + n].reshape(kvh, group, n, d).permute(2, 0, 1, 3)
    q = (q * scale).unsqueeze(1)
    k = k_cache.index_select(0, g.blocks).view(n, nb, kvh, d, bs).to(q.dtype)
    v = v_cache.index_select(0, g.blocks).view(n, nb, kvh, bs, d).to(q.dtype)
    scores = torch.matmul(q, k)  # [n, nb, KVH, G, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(n, kvh, group, nb * bs)
    scores.add_(g.mask(window).unsqueeze(1))  # [n, 1, 1, L]
    probs = torch.softmax(scores, dim=-1).view(n, kvh, group, nb, bs).permute(0, 3, 1, 2, 4)
    o = torch.matmul(probs, v).sum(1)  # [n, KVH, G, D]
    out[0, g.start : g.start + n] = o.reshape(n, kvh * group, d)


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PrefillSeq,
    window: int | None,
    causal: bool,
    scale: float,
    out: torch.Tensor,
) -> None:
    end = p.start + p.q_len
    q = query[:, :, p.start : end]
    if p.blocks is None:
        k = _as_cached(key[:, :, p.start : end], k_cache.dtype)
        v = _as_cached(value[:, :, p.start : end], v_cache.dtype)
    else:  # K [blocks, KVH, D, bs] / V [blocks, KVH, bs, D] -> [1, KVH, keys, D]
        _, kvh, d, _ = k_cache.shape
        s = p.prefix_len + p.q_len
        k = k_cache.index_select(0, p.blocks).permute(1, 0, 3, 2).reshape(kvh, -1, d)[None, :, :s]
        v = v_cache.index_select(0, p.blocks).transpose(0, 1).reshape(kvh, -1, d)[None, :, :s]
        k, v = k.to(q.dtype), v.to(q.dtype)
    mask = p.mask(window, causal, query.device)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and causal, scale=scale, enable_gqa=True
    )
    out[0, p.start : end] = o[0].transpose(0, 1)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a decode would read it back from a cache of ``cache_dtype`` (rounded, same dtype)."""
    if cache_dtype == x.dtype:
        return x
    return x.to(cache_dtype).to(x.dtype)


_registered = False


def register() -> None:
    """Register 'baton' with transformers' AttentionInterface (idempotent).

    No AttentionMaskInterface entry on purpose: for an attention name without
    one, transformers' mask builders return None at once (masking_utils'
    "custom attention without equivalent mask creation" exit) - the metadata
    carries the structure, and no per-step mask work happens in the model.
    """
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, paged_attention)
    _registered = True


def model_capabilities(hf_config: Any) -> tuple[bool, bool, str]:
    """(supports_chunked_prefill, supports_prefix_caching, reason) for a transformers config.

    Both need every layer to be causal: a bidirectional layer makes a token's
    keys depend on later tokens, so neither a cached prefix nor an earlier
    chunk can be reused. Sliding windows are handled by the attention masks.
    """
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if getattr(text, "use_bidirectional_attention", False):
        return (
            False,
            False,
            f"{text.model_type}: use_bidirectional_attention=True (layers are not causal)",
        )
    if getattr(text, "is_causal", True) is False:
        return False, False, f"{text.model_type}: is_causal=False"
    return True, True, ""
