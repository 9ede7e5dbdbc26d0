"""baton's paged attention == plain attention over each request's whole history.

Mixed flattened batches (decodes, fresh prefills, chunks after a cached prefix)
are built through the real InputBatch + StepInputBuilder from a SchedulerOutput,
the cached prefix K/V is written into the paged cache by slot beforehand, and
each request's output is compared with an eager reference (GQA expanded,
explicit causal / sliding-window mask over prefix + new tokens). Every case runs
on torch ops and on baton's C++ kernels (``kernels`` fixture).
"""

from __future__ import annotations

import platform
import random
from types import SimpleNamespace

import pytest
import torch

from baton.kernels import loader
from baton.kernels.attention import key_cache_view, model_capabilities, paged_attention
from baton.protocol import NewRequestData, SchedulerOutput
from baton.sampling_params import SamplingParams
from baton.testing.isa_build import pytest_in_build
from baton.testing.threads import torch_threads
from baton.worker.input_batch import InputBatch
from baton.worker.step_inputs import StepInputBuilder

D = 16


@pytest.fixture(params=[False, True], ids=["torch", "kernels"])
def kernels(request) -> bool:
    """Run a case on torch ops, then on the C++ kernels (skipped only without a C++ compiler)."""
    if request.param:
        request.getfixturevalue("cpu_kernel_ops")
    return request.param


def reference(q, k, v, prefix: int, window: int | None, causal: bool, scale: float) -> torch.Tensor:
    """q [H, T, D], k/v [KVH, P+T, D] -> [T, H, D] (eager attention, GQA expanded)."""
    h, t, _ = q.shape
    k = k.repeat_interleave(h // k.shape[0], 0)
    v = v.repeat_interleave(h // v.shape[0], 0)
    s = k.shape[1]
    qp = torch.arange(prefix, prefix + t)[:, None]
    kp = torch.arange(s)[None, :]
    ok = kp <= qp if causal else torch.ones(t, s, dtype=torch.bool)
    if window is not None:
        ok &= kp > qp - window
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~ok, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def run_case(
    reqs,
    block_size,
    heads,
    kv_heads,
    window=None,
    causal=True,
    num_blocks=400,
    seed=0,
    kernels=False,
    head_dim=D,
    cache_dtype=torch.float32,
    dtype=torch.float32,
):
    """``reqs``: list of (prefix_len, new_len). Returns max abs error over all requests.

    A narrower ``cache_dtype`` is checked against a float64 reference over the keys and
    values as the cache holds them (rounded), so only the computation's error counts.
    ``dtype``: the queries', keys' and values' (the model's compute dtype), rounded to it.
    """
    D = head_dim
    g = torch.Generator().manual_seed(seed)
    max_len = max(p + n for p, n in reqs) + 1
    batch = InputBatch(len(reqs), max_len, block_size)
    builder = StepInputBuilder(batch, sum(n for _, n in reqs), torch.device("cpu"), kernels=kernels)
    # finite garbage where nothing was written: gathered with whole blocks, it must be masked out
    cache = (torch.randn(1, 2, num_blocks, kv_heads, block_size, D, generator=g) * 100).to(
        cache_dtype
    )
    builder.set_kv_caches([cache[0]])
    k_cache = key_cache_view(cache[0])  # [blocks, kv_heads, D, block_size]
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    kv, new, num = {}, [], {}
    for i, (p, n) in enumerate(reqs):
        rid = f"r{i}"
        nb = -(-(p + n) // block_size)
        blocks = [free.pop() for _ in range(nb)]
        k = torch.randn(kv_heads, p + n, D, generator=g)
        v = torch.randn(kv_heads, p + n, D, generator=g)
        q = torch.randn(heads, n, D, generator=g)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        kv[rid] = (q, k, v, p)
        for pos in range(p):  # the cached prefix, written by "an earlier step"
            block, offset = blocks[pos // block_size], pos % block_size
            k_cache[block, :, :, offset] = k[:, pos]
            cache[0, 1, block, :, offset] = v[:, pos]
        new.append(
            NewRequestData(
                req_id=rid,
                prompt_token_ids=list(range(p + n)),
                sampling_params=SamplingParams(),
                block_ids=blocks,
                num_computed_tokens=p,
            )
        )
        num[rid] = n
    for r in new:
        batch.add_request(r)
    inputs = builder.build(
        SchedulerOutput(
            scheduled_new_reqs=new,
            num_scheduled_tokens=num,
            total_num_scheduled_tokens=sum(num.values()),
        )
    )
    total = sum(num.values())
    query = torch.empty(1, heads, total, D, dtype=dtype)
    key = torch.empty(1, kv_heads, total, D, dtype=dtype)
    value = torch.empty(1, kv_heads, total, D, dtype=dtype)
    for rid, start in zip(inputs.flat_req_ids, inputs.query_start, strict=True):
        q, k, v, p = kv[rid]
        n = q.shape[1]
        query[0, :, start : start + n] = q
        key[0, :, start : start + n] = k[:, p:]
        value[0, :, start : start + n] = v[:, p:]
    module = SimpleNamespace(layer_idx=0, is_causal=causal)
    scale = D**-0.5
    out, _ = paged_attention(
        module,
        query,
        key,
        value,
        None,
        scaling=scale,
        sliding_window=window,
        baton_attn=inputs.attn,
    )
    assert out.shape == (1, total, heads, D) and out.dtype == dtype
    err = 0.0
    for rid, start in zip(inputs.flat_req_ids, inputs.query_start, strict=True):
        q, k, v, p = kv[rid]
        n = q.shape[1]
        if cache_dtype == torch.float32 and dtype == torch.float32:
            want = reference(q, k, v, p, window, causal, scale)
        else:
            k, v = (x.to(cache_dtype).double() for x in (k, v))
            want = reference(q.double(), k, v, p, window, causal, scale)
        err = max(err, (out[0, start : start + n].double() - want).abs().max().item())
    return err


MIXED = [
    (0, 7),
    (12, 1),
    (0, 1),
    (5, 9),
    (30, 1),
    (3, 1),
    (16, 16),
    (0, 20),
    (47, 1),
    (1, 1),
    (2, 1),
    (9, 1),
]


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_mixed_batch_matches_reference(block_size, heads, kv_heads, kernels):
    assert run_case(MIXED, block_size, heads, kv_heads, kernels=kernels) < 1e-5


@pytest.mark.parametrize("window", [1, 4, 9])
def test_sliding_window(window, kernels):
    assert run_case(MIXED, 4, 4, 2, window=window, kernels=kernels) < 1e-5


def test_non_causal_layers_attend_to_the_whole_chunk(kernels):
    assert run_case([(0, 8), (0, 3), (6, 1)], 4, 4, 2, causal=False, kernels=kernels) < 1e-5


def test_decodes_of_very_different_lengths_form_groups(kernels):
    reqs = [(200, 1), (190, 1), (90, 1), (80, 1), (10, 1), (9, 1), (3, 1), (0, 1), (40, 5)]
    assert run_case(reqs, 8, 4, 2, kernels=kernels) < 1e-5


# the kernels' compiled fast paths (head_dim 64 / 128 with 16-slot blocks) next to the generic one
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (64, 8), (80, 16)])
@pytest.mark.parametrize("window", [None, 37])
def test_kernel_sizes_match_reference(head_dim, block_size, window, kernels):
    reqs = [(300, 1), (161, 1), (15, 1), (16, 1), (17, 1), (0, 1), (40, 9), (0, 33)]
    err = run_case(
        reqs, block_size, 9, 3, window=window, head_dim=head_dim, kernels=kernels, num_blocks=80
    )
    assert err < 1e-5


def test_new_keys_are_written_by_slot(kernels):
    batch = InputBatch(2, 64, 4)
    builder = StepInputBuilder(batch, 64, torch.device("cpu"), kernels=kernels)
    cache = torch.zeros(1, 2, 10, 1, 4, D)  # 10 blocks of 4 slots, 1 KV head
    builder.set_kv_caches([cache[0]])
    r = NewRequestData(
        req_id="a",
        prompt_token_ids=list(range(6)),
        sampling_params=SamplingParams(),
        block_ids=[7, 2],
        num_computed_tokens=0,
    )
    batch.add_request(r)
    inputs = builder.build(
        SchedulerOutput(
            scheduled_new_reqs=[r], num_scheduled_tokens={"a": 6}, total_num_scheduled_tokens=6
        )
    )
    key = torch.arange(6.0).view(1, 1, 6, 1).expand(1, 1, 6, D).contiguous()
    paged_attention(
        SimpleNamespace(layer_idx=0, is_causal=True),
        torch.randn(1, 2, 6, D),
        key,
        key.clone(),
        None,
        scaling=0.25,
        baton_attn=inputs.attn,
    )
    slots = [28, 29, 30, 31, 8, 9]  # block 7 then block 2, block size 4
    keys = key_cache_view(cache[0])  # [blocks, kv_heads, D, block_size]
    assert keys[:, 0, 0, :].reshape(-1)[slots].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert cache[0, 1, :, 0, :, 0].reshape(-1)[slots].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert keys.count_nonzero() == 5 * D  # key 0.0 is zero too: nothing else was written


def test_missing_metadata_is_a_clear_error():
    with pytest.raises(RuntimeError, match="baton_attn"):
        paged_attention(
            SimpleNamespace(layer_idx=0),
            torch.zeros(1, 2, 1, D),
            torch.zeros(1, 1, 1, D),
            torch.zeros(1, 1, 1, D),
            None,
            scaling=1.0,
        )


def test_model_capabilities():
    from transformers import GemmaConfig, LlamaConfig, MistralConfig

    assert model_capabilities(LlamaConfig()) == (True, True, "")
    assert model_capabilities(MistralConfig(sliding_window=8))[:2] == (True, True)
    chunked, prefix, reason = model_capabilities(GemmaConfig(use_bidirectional_attention=True))
    assert (chunked, prefix) == (False, False) and "bidirectional" in reason


LOW_PRECISION = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("cache_dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize(("block_size", "heads", "kv_heads"), [(1, 4, 4), (4, 6, 1), (16, 4, 2)])
def test_low_precision_cache_matches_rounded_reference(
    cache_dtype, block_size, heads, kv_heads, kernels
):
    err = run_case(MIXED, block_size, heads, kv_heads, kernels=kernels, cache_dtype=cache_dtype)
    assert err < 1e-5


@pytest.mark.parametrize("cache_dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (80, 16)])
@pytest.mark.parametrize("window", [None, 37])
def test_low_precision_kernel_sizes(cache_dtype, head_dim, block_size, window, kernels):
    reqs = [(300, 1), (161, 1), (15, 1), (17, 1), (0, 1), (40, 9), (0, 33)]
    err = run_case(
        reqs,
        block_size,
        9,
        3,
        window=window,
        head_dim=head_dim,
        kernels=kernels,
        num_blocks=80,
        cache_dtype=cache_dtype,
    )
    assert err < 1e-5


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 4), (64, 16)])
def test_16_bit_activations_match_rounded_reference(dtype, head_dim, block_size, kernels):
    # A bfloat16/float16 model: its queries, keys and values, and a cache of its dtype. The
    # kernels widen them to float32 (decode, cache writes); prefill is SDPA in the dtype itself.
    reqs = [(300, 1), (161, 1), (15, 1), (0, 1), (40, 9), (0, 33)]
    err = run_case(
        reqs,
        block_size,
        9,
        3,
        head_dim=head_dim,
        kernels=kernels,
        num_blocks=200,
        cache_dtype=dtype,
        dtype=dtype,
    )
    assert err < 3e-2  # one rounding of outputs below ~4 in magnitude, plus SDPA's own


def test_16_bit_decode_through_kernels_is_closer_than_torch(cpu_kernel_ops):
    # the decode rows alone: float32 arithmetic over the widened values, one rounding at the end
    reqs = [(300, 1), (161, 1), (15, 1), (17, 1), (2, 1)]
    args = dict(num_blocks=80, head_dim=64, cache_dtype=torch.bfloat16, dtype=torch.bfloat16)
    assert run_case(reqs, 16, 9, 3, kernels=True, **args) <= run_case(
        reqs, 16, 9, 3, kernels=False, **args
    )


def _awkward_values(n: int) -> torch.Tensor:
    """float32 values that test rounding: ties, just-above-ties, tiny, huge, signed zeros."""
    g = torch.Generator().manual_seed(1)
    base = (
        torch.randn(n, generator=g)
        * torch.logspace(-9, 6, n).flip(0)[torch.randperm(n, generator=g)]
    )
    bits = base.view(torch.int32)
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000  # bfloat16 ties
    bits[3::7] = (bits[3::7] & ~0x1FFF) | 0x1000  # float16 ties
    base[5::11] = 0.0
    base[6::11] = -0.0
    base[7::13] = 70000.0  # past float16's range: inf in both implementations
    base[8::13] = 6e-8  # float16 subnormal
    return base


@pytest.mark.parametrize("cache_dtype", LOW_PRECISION, ids=str)
def test_kernel_write_rounds_like_torch(cpu_kernel_ops, cache_dtype):
    tokens, kvh, bs, d = 37, 2, 4, 24
    key = _awkward_values(tokens * kvh * d).view(tokens, kvh, d)
    value = -_awkward_values(tokens * kvh * d).view(tokens, kvh, d).flip(0).contiguous()
    slots = torch.randperm(12 * bs, generator=torch.Generator().manual_seed(2))[:tokens]
    caches = [torch.zeros(2, 12, kvh, bs, d, dtype=cache_dtype) for _ in range(2)]
    k_c, v_c = key_cache_view(caches[0]), caches[0][1]
    torch.ops.baton.paged_write(key, value, k_c, v_c, slots)
    blocks, offsets = slots // bs, slots % bs
    key_cache_view(caches[1])[blocks, :, :, offsets] = key.to(cache_dtype)
    caches[1][1][blocks, :, offsets] = value.to(cache_dtype)
    assert torch.equal(caches[0].view(torch.int16), caches[1].view(torch.int16))


def test_kernels_refuse_mixed_cache_dtypes(cpu_kernel_ops):
    k = torch.zeros(2, 1, 4, 4, dtype=torch.float16)
    v = torch.zeros(2, 1, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share one dtype of float32, float16 or bfloat16"):
        torch.ops.baton.paged_write(
            torch.ones(1, 1, 4), torch.ones(1, 1, 4), k, v, torch.tensor([1])
        )
    with pytest.raises(RuntimeError, match="share one dtype"):
        torch.ops.baton.paged_write(
            torch.ones(1, 1, 4), torch.ones(1, 1, 4), k.double(), k.double(), torch.tensor([1])
        )


@pytest.mark.slow
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or loader.compiler() is None,
    reason="the generic build is x86-64-v2; needs a C++ compiler",
)
def test_low_precision_kernels_without_f16c():
    """BATON_KERNEL_ISA=generic (no AVX2, no F16C): the portable conversions pass the same tests."""
    out = pytest_in_build(
        "generic",
        __file__,
        "(low_precision and kernels) or rounds_like_torch or mixed_cache_dtypes",
        timeout=900,
    )
    assert "skipped" not in out


@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cache_dtype", [torch.float32, *LOW_PRECISION], ids=str)
def test_grouped_heads_keep_each_heads_sums(cpu_kernel_ops, group, head_dim, cache_dtype):
    # groups of 3 or 4 query heads per kv head run their heads interleaved (group_scores,
    # group_values); each head's output must be what the one-head-per-kv-head path gives it
    g = torch.Generator().manual_seed(group * head_dim)
    kvh, bs, blocks = 2, 16, 40
    lens = torch.tensor([1, 15, 16, 17, 200, 333])
    table = torch.stack([torch.randperm(blocks, generator=g)[:22] for _ in lens])
    k_cache = torch.randn(blocks, kvh, head_dim, bs, generator=g).to(cache_dtype)
    v_cache = torch.randn(blocks, kvh, bs, head_dim, generator=g).to(cache_dtype)
    q = torch.randn(len(lens), kvh * group, head_dim, generator=g)
    grouped = torch.empty_like(q)
    torch.ops.baton.paged_decode(q, k_cache, v_cache, table, lens, 0, 0.125, grouped)
    for j in range(group):
        qj = q.view(len(lens), kvh, group, head_dim)[:, :, j].contiguous()
        one = torch.empty_like(qj)
        torch.ops.baton.paged_decode(qj, k_cache, v_cache, table, lens, 0, 0.125, one)
        assert torch.equal(grouped.view(len(lens), kvh, group, head_dim)[:, :, j], one)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_split_by_work_keep_each_rows_bits(cpu_kernel_ops, threads):
    # the threads take rows by the keys they read (a prompt chunk's rows attend over 1..n keys);
    # whichever thread takes a row, it must come out as it does alone
    g = torch.Generator().manual_seed(threads)
    kvh, heads, dim, bs, blocks = 3, 9, 64, 16, 24
    lens = torch.randperm(300, generator=g)[:120] + 1
    table = torch.randperm(blocks, generator=g)[:19].repeat(len(lens), 1)
    k_cache = torch.randn(blocks, kvh, dim, bs, generator=g)
    v_cache = torch.randn(blocks, kvh, bs, dim, generator=g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    together = torch.empty_like(q)
    with torch_threads(threads):
        torch.ops.baton.paged_decode(q, k_cache, v_cache, table, lens, 0, 0.125, together)
    for i in range(len(lens)):
        alone = torch.empty_like(q[i : i + 1])
        torch.ops.baton.paged_decode(
            q[i : i + 1], k_cache, v_cache, table[i : i + 1], lens[i : i + 1], 0, 0.125, alone
        )
        assert torch.equal(alone, together[i : i + 1]), i
