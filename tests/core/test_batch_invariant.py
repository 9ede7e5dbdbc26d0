"""executor.batch_invariant, operation by operation: each kernel's row equals the same row
computed alone, for every row count the kernels dispatch on (1..40 and prefill sizes).

The kernels' rows: linear_small (float32 weights), linear_q with ``invariant=True`` and
linear_q8a (quantized weights, every format), decode_layers with ``invariant=True`` (the whole
layer stack: norms, linears, rotary, paged attention over each token's own context, the LM head;
one and two threads), the LM head outside the stack, and the sampler's rows (greedy tokens,
logprobs, seeded draws). The default kernels keep their arithmetic: linear_q without the flag
still sums one and two rows its own way (the test shows the flag is what makes them equal).
"""

from __future__ import annotations

import pytest
import torch

from baton.config import BatonConfig
from baton.config.sections import BATCH_INVARIANT_ENV
from baton.errors import ConfigError, ExecutorError
from baton.quant import QType
from baton.testing.isa_build import AVX2_BUILD_SKIP, avx2_build_beside, pytest_in_build
from baton.testing.tiny_model import tiny_model
from baton.worker.sampler import Sampler, SamplingMetadata

from .test_fast_decode import _random_caches, _stack_call
from .test_model_runner import make_runner
from .test_quant import random_blocks, shape_for

pytestmark = pytest.mark.usefixtures("cpu_kernel_ops")

#: Every row count the kernels dispatch on (row groups of 8, 1-2 row paths, the old 16 / 32 row
#: limits), then prefill-sized calls.
ROW_COUNTS = (*range(1, 41), 64, 100, 131)
ROWS = max(ROW_COUNTS)


def assert_rows_alone(op, x: torch.Tensor) -> None:
    """``op(x[a:a+m])`` equals ``op`` of each row alone, for every m in ROW_COUNTS and several
    starting rows a (a row's position in the call changes too)."""
    alone = torch.cat([op(x[i : i + 1]) for i in range(x.shape[0])])
    for m in ROW_COUNTS:
        for a in {0, (m * 7) % (x.shape[0] - m + 1)}:
            got = op(x[a : a + m])
            assert torch.equal(got, alone[a : a + m]), (m, a)


def test_linear_small_rows_do_not_depend_on_the_rows_beside_them():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 100, generator=g)  # K not a multiple of the vector width: a scalar tail
    x = torch.randn(ROWS, 100, generator=g)

    def op(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], w.shape[0])
        torch.ops.baton.linear_small(rows.contiguous(), w, out)
        return out

    assert_rows_alone(op, x)


@pytest.mark.slow
@pytest.mark.skipif(not avx2_build_beside(), reason=AVX2_BUILD_SKIP)
def test_kernel_rows_alone_in_the_avx2_build():
    """BATON_KERNEL_ISA=avx2 (what a CPU without AVX-512 builds): the kernels' rows and the layer
    stack's, in a subprocess. (linear_small's last weight row once summed without FMA at one row
    of x there and with it beside others.)"""
    pytest_in_build("avx2", __file__, "rows_do_not_depend or rows_equal_each_row_alone or by_parts")


@pytest.mark.parametrize("qtype", list(QType))
def test_linear_q_invariant_rows_do_not_depend_on_the_rows_beside_them(qtype):
    n, k = shape_for(qtype, n=37)
    raw = random_blocks(qtype, n, k, seed=int(qtype))
    bias = torch.randn(n)
    x = torch.randn(ROWS, k, generator=torch.Generator().manual_seed(int(qtype)))
    assert_rows_alone(lambda r: torch.ops.baton.linear_q(r, raw, int(qtype), bias, True), x)
    # without the flag one and two rows are summed their own (faster) way
    three = torch.ops.baton.linear_q(x[:3], raw, int(qtype), bias)
    one = torch.ops.baton.linear_q(x[:1], raw, int(qtype), bias)
    inv = torch.ops.baton.linear_q(x[:1], raw, int(qtype), bias, True)
    assert torch.equal(inv, three[:1])
    assert not torch.equal(one, three[:1])


@pytest.mark.parametrize("qtype", list(QType))
def test_linear_q8a_rows_do_not_depend_on_the_rows_beside_them(qtype):
    n, k = shape_for(qtype, n=37)
    raw = random_blocks(qtype, n, k, seed=int(qtype) + 1)
    x = torch.randn(ROWS, k, generator=torch.Generator().manual_seed(int(qtype) + 1))
    assert_rows_alone(lambda r: torch.ops.baton.linear_q8a(r, raw, int(qtype)), x)


def _invariant_runner(quantization: str = "none", activations: str = "none", cache="float32"):
    path = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)  # biases, GQA
    return make_runner(
        path,
        block_size=4,
        budget=256,
        max_seqs=16,
        **{
            "executor.batch_invariant": True,
            "model.quantization": quantization,
            "model.activation_quantization": activations,
            "cache.dtype": cache,
        },
    )


@pytest.mark.parametrize(
    ("quantization", "activations", "cache"),
    [
        ("none", "none", "float32"),
        ("int4", "none", "float32"),
        ("int8", "int8", "bfloat16"),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_stack_rows_equal_each_row_alone(quantization, activations, cache, threads):
    """A step of 70 tokens: a 40-token prompt chunk after 6 cached tokens, a second request's
    27-token chunk from 0, three decode rows. decode_layers(invariant=True) over all of them
    gives each token the bits it gets alone (its context already in the cache), at 1 and 2
    threads, with the head inside; and the hidden rows through the head outside the stack."""
    runner = _invariant_runner(quantization, activations, cache)
    fast = runner.fast_decode
    assert fast is not None and fast.head_args is not None
    g = torch.Generator().manual_seed(11)
    dtype = getattr(torch, cache)
    caches = _random_caches(runner, dtype, g)
    blocks = torch.randperm(256, generator=g)[: 5 * 13].view(5, 13)
    owner = [0] * 40 + [1] * 27 + [2, 3, 4]
    pos = [*range(6, 46), *range(27), 20, 3, 49]
    table = blocks[owner].contiguous()
    positions = torch.tensor(pos)
    lens = positions + 1
    slots = table.gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    hidden = torch.randn((len(owner), fast.norms[0].numel()), generator=g)
    head = fast.head_args[:4]
    no_head = (None, -1, 0, None)
    with torch.inference_mode():
        together, k1, v1 = _inv_call(
            fast, caches, hidden, positions, slots, table, lens, head, threads
        )
        written = list(zip(k1, v1, strict=True))
        normed, _, _ = _inv_call(
            fast, written, hidden, positions, slots, table, lens, no_head, threads
        )
        for i in range(len(owner)):
            r = slice(i, i + 1)
            alone, _, _ = _inv_call(
                fast, written, hidden[r], positions[r], slots[r], table[r], lens[r], head, threads
            )
            assert torch.equal(alone, together[r]), i
        outside = fast.invariant_head(normed)
        assert torch.equal(outside, together)
        for m in (1, 2, 3, 17, 33):  # the head alone, several row counts
            assert torch.equal(fast.invariant_head(normed[5 : 5 + m]), together[5 : 5 + m])


@pytest.mark.parametrize("threads", [1, 2])
def test_layer_stack_by_parts_equals_the_whole_stack(threads):
    """decode_layers one half layer at a time (``part``: what a tensor-parallel rank runs, its
    o_proj / down_proj output added into the residual stream by the caller), then the final norm
    alone, gives the whole stack's bits; a part with a head, outside [0, 2L] or without
    invariant=True is refused."""
    runner = _invariant_runner()
    fast = runner.fast_decode
    g = torch.Generator().manual_seed(12)
    caches = _random_caches(runner, torch.float32, g)
    table = torch.randperm(256, generator=g)[:13].view(1, 13).expand(30, 13).contiguous()
    positions = torch.arange(4, 34)
    slots = table.gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    hidden = torch.randn((30, fast.norms[0].numel()), generator=g)
    no_head = (None, -1, 0, None)
    args = (positions, slots, table, positions + 1)
    halves = len(fast.norms) - 1
    with torch.inference_mode():
        whole, k1, v1 = _inv_call(fast, caches, hidden, *args, no_head, threads)
        written = list(zip(k1, v1, strict=True))
        h = hidden
        for part in range(halves):
            y, _, _ = _inv_call(fast, written, h, *args, no_head, threads, part)
            h = h + y
        normed, _, _ = _inv_call(fast, written, h, *args, no_head, threads, halves)
        assert torch.equal(normed, whole)
        for head, part, invariant in (
            (fast.head_args[:4], 0, True),
            (no_head, halves + 1, True),
            (no_head, 0, False),
        ):
            with pytest.raises(RuntimeError, match="part"):
                _stack_call(fast, written, h, *args, head, threads, True, invariant, part)


def _inv_call(fast, caches, hidden, positions, slots, table, lens, head, threads, part=-1):
    return _stack_call(
        fast,
        caches,
        hidden,
        positions,
        slots,
        table,
        lens,
        head,
        threads,
        shared=True,
        invariant=True,
        part=part,
    )


def test_sampler_rows_do_not_depend_on_the_rows_beside_them():
    """Greedy tokens, logprobs (top 5, the sampled token's rank) and seeded draws with top-k /
    top-p / min-p of a row are those it gets sampled alone."""
    g = torch.Generator().manual_seed(5)
    vocab = 4099
    logits = torch.randn(64, vocab, generator=g) * 3

    def md(rows: range, greedy: bool) -> SamplingMetadata:
        n = len(rows)
        m = SamplingMetadata(all_greedy=greedy, num_logprobs=[5] * n)
        if not greedy:
            m.greedy = torch.zeros(n, dtype=torch.bool)
            m.temperature = torch.tensor([0.7 + 0.01 * r for r in rows])
            m.top_k = torch.tensor([(r % 3) * 20 for r in rows])
            m.top_p = torch.tensor([0.9 if r % 2 else 1.0 for r in rows])
            m.min_p = torch.tensor([0.05 if r % 5 == 0 else 0.0 for r in rows])
            m.seeds = [(1234 + r, r) for r in rows]
        return m

    sampler = Sampler(torch.device("cpu"))
    for greedy in (True, False):
        alone = [sampler(logits[i : i + 1].clone(), md(range(i, i + 1), greedy)) for i in range(64)]
        for m in (2, 3, 8, 17, 40, 64):
            for a in {0, 64 - m}:
                out = sampler(logits[a : a + m].clone(), md(range(a, a + m), greedy))
                for j in range(m):
                    one = alone[a + j]
                    assert out.token_ids[j].item() == one.token_ids[0].item(), (greedy, m, a, j)
                    assert out.logprobs[j] == one.logprobs[0], (greedy, m, a, j)


def test_config_refuses_what_it_cannot_honour(monkeypatch):
    for overrides, named in (
        ({"executor.pipeline_parallel_size": 2}, "executor.pipeline_parallel_size=2"),
        ({"executor.device": "cuda"}, "executor.device='cuda'"),
        ({"executor.cpu_kernels": False}, "executor.cpu_kernels=False"),
        ({"lora.enable_lora": True}, "lora.enable_lora=True"),
        ({"model.dtype": "bfloat16"}, "model.dtype='bfloat16'"),
    ):
        with pytest.raises(ConfigError, match="batch_invariant") as e:
            BatonConfig.load(**{"executor.batch_invariant": True, **overrides})
        assert named in str(e.value)
    assert BatonConfig.load().executor.batch_invariant is False
    # tensor parallelism holds within a size (tests/plugins/cuda_tp/test_batch_invariant.py)
    tp = BatonConfig.load(
        **{"executor.batch_invariant": True, "executor.tensor_parallel_size": 2}
    ).executor
    assert tp.batch_invariant and tp.tensor_parallel_size == 2
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert BatonConfig.load().executor.batch_invariant is True
    assert BatonConfig.load(**{"executor.batch_invariant": False}).executor.batch_invariant is False
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "maybe")
    with pytest.raises(ConfigError, match="BATON_BATCH_INVARIANT='maybe'"):
        BatonConfig.load()


@pytest.mark.parametrize(
    ("arch", "overrides", "reason"),
    [
        ("gemma", {}, "GemmaForCausalLM is not one of"),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ],
)
def test_runner_refuses_models_the_stack_does_not_run(arch, overrides, reason):
    with pytest.raises(ExecutorError, match="batch_invariant") as e:
        make_runner(tiny_model(arch, **overrides), **{"executor.batch_invariant": True})
    assert reason in str(e.value)
