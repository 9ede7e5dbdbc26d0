"""ModelRunner driven by hand-built SchedulerOutputs: greedy tokens == transformers generate.

Mixed batches with chunked prefill, a block size that splits prompts across
blocks, prefix sharing, preemption and resumption, structured-output sampling.
"""

from __future__ import annotations

import os

import pytest
import torch

from baton.config import BatonConfig
from baton.errors import ExecutorError
from baton.kernels import loader
from baton.protocol import (
    CachedRequestData,
    GrammarOutput,
    KVCacheConfig,
    NewRequestData,
    SchedulerOutput,
)
from baton.sampling_params import SamplingParams
from baton.testing.runner_driver import Driver
from baton.testing.tiny_model import tiny_model
from baton.worker import kv_cache
from baton.worker.model_runner import ModelRunner
from baton.worker.worker import runner_settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_BLOCKS = 256
PROMPT_LENS = (5, 17, 1, 30, 9, 45, 12)
#: Greedy output must match exactly this long; later a divergence is allowed only at a near-tie.
EXACT_TOKENS = 32
NEAR_TIE = 1e-4


def make_runner(path, block_size=4, budget=24, max_seqs=8, **overrides) -> ModelRunner:
    cfg = BatonConfig.load(
        model=str(path),
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        **overrides,
    )
    runner = ModelRunner(runner_settings(cfg), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(KVCacheConfig(num_blocks=NUM_BLOCKS, block_size=block_size))
    return runner


def prompts(seed=1, lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]


_refs: dict[str, torch.nn.Module] = {}


def hf_greedy(path, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate (its default attention) and the logits of each step."""
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _refs:
        _refs[key] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = _refs[key].generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits)[:, 0]


def assert_greedy_parity(got: list[int], want: list[int], logits: torch.Tensor) -> None:
    """``got`` equals ``want`` (which may stop early at EOS), except at a late near-tie."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            top2 = logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert i >= EXACT_TOKENS and gap < NEAR_TIE, (
                f"diverged at token {i}: got {a}, transformers {b}, top-2 logit gap {gap:.2e}"
            )
            return
    assert len(got) >= len(want)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", {}),
        ("qwen3", {}),
        ("gemma", {}),
        ("phi3", {}),
        ("mistral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    ],
    ids=[
        "llama",
        "qwen2",
        "mistral",
        "qwen3",
        "gemma",
        "phi3",
        "mistral-sliding",
        "qwen2-sliding-some-layers",
    ],
)
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_greedy_matches_transformers(arch, overrides, cpu_kernels):
    path = tiny_model(arch, **overrides)
    runner = make_runner(path, cpu_kernels=cpu_kernels)
    assert runner.kernels is (cpu_kernels and loader.compiler() is not None)
    d = Driver(runner, NUM_BLOCKS, 4, budget=24)
    ps = prompts()
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, max_tokens=20 + i)  # different lengths: requests leave at different steps
    d.run()
    assert runner.input_batch.num_reqs == 0 or all(
        d.all[r].done for r in runner.input_batch.req_ids
    )
    for i, p in enumerate(ps):
        want, logits = hf_greedy(path, p, 20 + i)
        assert_greedy_parity(d.all[f"r{i}"].output, want, logits)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_block_sizes_and_budgets(block_size):
    path = tiny_model("qwen2")
    runner = make_runner(path, block_size=block_size, budget=7, max_seqs=4)
    d = Driver(runner, NUM_BLOCKS, block_size, budget=7, seed=block_size)
    ps = prompts(seed=2, lens=(13, 2, 20, 6))
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, max_tokens=12)
    d.run()
    for i, p in enumerate(ps):
        want, logits = hf_greedy(path, p, 12)
        assert_greedy_parity(d.all[f"r{i}"].output, want, logits)


def test_prefix_written_by_another_request_is_reused():
    path = tiny_model("llama")
    runner = make_runner(path)
    d = Driver(runner, NUM_BLOCKS, 4, budget=24)
    shared = prompts(seed=3, lens=(18,))[0]
    a = d.add("a", [*shared, 11, 12], max_tokens=10)
    while a.computed < len(a.prompt):
        d.step()
    b = d.add("b", [*shared, 13, 14, 15], max_tokens=10, prefix_from=a, prefix_tokens=16)
    assert b.computed == 16  # four full blocks borrowed; only the rest is computed
    d.run()
    for r in (a, b):
        want, logits = hf_greedy(path, r.prompt, 10)
        assert_greedy_parity(r.output, want, logits)


def test_preempted_request_resumes_with_the_same_tokens():
    path = tiny_model("mistral")
    runner = make_runner(path)
    d = Driver(runner, NUM_BLOCKS, 4, budget=24)
    ps = prompts(seed=4, lens=(9, 14, 3))
    reqs = [d.add(f"r{i}", p, max_tokens=16) for i, p in enumerate(ps)]
    for _ in range(6):
        d.step()
    assert 0 < len(reqs[1].output) < 16
    d.preempt(reqs[1])  # comes back as a new request carrying its output so far
    d.run()
    for r in reqs:
        want, logits = hf_greedy(path, r.prompt, 16)
        assert_greedy_parity(r.output, want, logits)


def test_seeded_sampling_survives_preemption_and_companions():
    path = tiny_model("qwen3")
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    p = prompts(seed=5, lens=(11,))[0]

    def run(preempt: bool, companions: int) -> list[int]:
        runner = make_runner(path)
        d = Driver(runner, NUM_BLOCKS, 4, budget=24)
        r = d.add("s", p, max_tokens=14, params=sp)
        for i, q in enumerate(prompts(seed=6, lens=(7, 20, 3))[:companions]):
            d.add(f"c{i}", q, max_tokens=9, params=SamplingParams(temperature=0.8))
        for _ in range(5):
            d.step()
        if preempt:
            d.preempt(r)
        d.run()
        return r.output

    alone = run(False, 0)
    assert run(True, 3) == alone
    assert run(False, 2) == alone


def _new(rid, prompt, blocks, sp=None):
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sp or SamplingParams(temperature=0),
        block_ids=blocks,
        num_computed_tokens=0,
    )


def test_structured_output_waits_for_the_bitmask():
    runner = make_runner(tiny_model("llama"))
    vocab = runner.vocab_size
    so = SchedulerOutput(
        scheduled_new_reqs=[_new("g", [5, 6, 7], [3]), _new("f", [8, 9], [4])],
        num_scheduled_tokens={"g": 3, "f": 2},
        total_num_scheduled_tokens=5,
        structured_output_req_ids=["g"],
    )
    assert runner.execute_model(so) is None
    bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
    bitmask[0, 1234 // 32] = 1 << (1234 % 32)
    out = runner.sample_tokens(GrammarOutput(req_ids=["g"], bitmask=bitmask.numpy()))
    assert out.req_ids == ["g", "f"]
    assert out.sampled_token_ids[0] == [1234]
    assert len(out.sampled_token_ids[1]) == 1
    with pytest.raises(ExecutorError, match="pending"):
        runner.sample_tokens(None)


def test_mid_prompt_chunk_samples_nothing_and_logprobs_come_back():
    runner = make_runner(tiny_model("llama"))
    sp = SamplingParams(temperature=0, logprobs=2)
    so = SchedulerOutput(
        scheduled_new_reqs=[_new("a", list(range(10, 20)), [0, 1, 2], sp)],
        num_scheduled_tokens={"a": 6},
        total_num_scheduled_tokens=6,
    )
    out = runner.execute_model(so)
    assert out.sampled_token_ids == [[]] and not out.logprobs
    so = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["a"], new_token_ids=[[]], new_block_ids=[[]], num_computed_tokens=[6]
        ),
        num_scheduled_tokens={"a": 4},
        total_num_scheduled_tokens=4,
    )
    out = runner.execute_model(so)
    [tok] = out.sampled_token_ids[0]
    [lp] = out.logprobs["a"]
    assert lp.token_ids[0] == tok and lp.sampled_rank == 1 and len(lp.token_ids) == 3


def test_contract_violations_are_executor_errors():
    runner = make_runner(tiny_model("llama"))
    unknown = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["x"], new_token_ids=[[1]], new_block_ids=[[]], num_computed_tokens=[0]
        ),
        num_scheduled_tokens={"x": 1},
        total_num_scheduled_tokens=1,
    )
    with pytest.raises(ExecutorError, match="not in the model runner's batch"):
        runner.execute_model(unknown)
    too_many = SchedulerOutput(
        scheduled_new_reqs=[_new("a", [1, 2, 3], [0])],
        num_scheduled_tokens={"a": 5},
        total_num_scheduled_tokens=5,
    )
    with pytest.raises(ExecutorError, match="has 3 tokens"):
        runner.execute_model(too_many)


def test_kv_cache_spec_and_memory():
    runner = make_runner(tiny_model("qwen2"), kv_cache_memory="3MiB")
    spec = runner.get_kv_cache_spec()
    assert (spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype) == (
        4,
        3,
        2,
        16,
        "float32",
    )
    assert runner.determine_available_memory() == 3 * 2**20
    runner.cache.kv_cache_memory = None
    per_token = spec.page_size_bytes // spec.block_size
    assert runner.determine_available_memory() == min(
        2 * 2**30, 8 * runner.max_model_len * per_token
    )
    assert runner.kv_caches[0].shape == (
        2,
        NUM_BLOCKS,
        2,
        4,
        16,
    )  # K/V, blocks, KV heads, slots, dim


def test_kv_cache_dtype_sizes_the_cache(monkeypatch):
    runner = make_runner(tiny_model("llama"), **{"cache.dtype": "bfloat16"})
    spec = runner.get_kv_cache_spec()
    assert spec.dtype == "bfloat16" and runner.kv_caches[0].dtype == torch.bfloat16
    assert spec.page_size_bytes == 2 * spec.num_layers * 4 * spec.num_kv_heads * spec.head_size * 2
    # the CPU default keeps the float32 cache's tokens, in half the memory
    monkeypatch.setattr(kv_cache, "CPU_DEFAULT_KV_BYTES", 2**20)
    assert runner.determine_available_memory() == 2**19
    runner.cache.kv_cache_memory = "1MiB"  # an explicit budget buys twice the blocks
    assert runner.determine_available_memory() == 2**20
