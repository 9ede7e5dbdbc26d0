"""executor.fast_decode: decode-only steps of Llama-block models through decode_layers.

Greedy tokens equal transformers' (near-tie rule) with the fast path taken for
every decode-only step; batches of decodes at different context lengths whose
blocks cross boundaries, beyond the row counts where the linears change kernels;
quantized linears; and the fast path refused where it does not apply.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from baton.errors import ExecutorError
from baton.kernels import loader
from baton.kernels.exact_packing import PACKED_EXACT_ENV
from baton.quant import QuantLinear
from baton.sampling_params import SamplingParams
from baton.testing.runner_driver import Driver
from baton.testing.threads import torch_threads
from baton.testing.tiny_model import tiny_model
from baton.worker import model_runner
from baton.worker.fast_decode import FastDecode
from baton.worker.fast_decode_build import BF16_WEIGHTS, build_fast_decode
from baton.worker.model_runner import ModelRunner
from baton.worker.worker import runner_settings

from .test_model_runner import NUM_BLOCKS, assert_greedy_parity, hf_greedy, make_runner, prompts

pytestmark = pytest.mark.usefixtures("cpu_kernel_ops")


def q8p_built() -> bool:
    """Whether the kernels have linear_q8p / linear_qp (AVX-512 VNNI, or their AVX2 loop)."""
    return bool(torch.ops.baton.q8p_kernel())


def run_driver(runner, lens, max_tokens, block_size=4, budget=24, seed=1, grow=1) -> Driver:
    """Requests of prompt lengths ``lens``; request i generates ``max_tokens + grow * i`` tokens."""
    d = Driver(runner, NUM_BLOCKS, block_size, budget=budget)
    for i, p in enumerate(prompts(seed=seed, lens=lens)):
        d.add(f"r{i}", p, max_tokens=max_tokens + grow * i)
    d.run()
    return d


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),  # q/k/v biases
        ("mistral", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        # cos/sin tabulated at load (linear) or from the rotary module every step (dynamic)
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ],
    ids=["llama", "qwen2", "mistral", "llama-biases", "rope-linear", "rope-dynamic"],
)
def test_greedy_matches_transformers_through_the_fast_path(arch, overrides):
    path = tiny_model(arch, **overrides)
    runner = make_runner(path, block_size=4, budget=24, max_seqs=8)
    assert runner.fast_decode is not None
    dynamic = overrides.get("rope_scaling", {}).get("rope_type") == "dynamic"
    assert (runner.fast_decode.cos_table is None) is dynamic
    lens = (5, 17, 1, 30, 9, 45, 12)
    d = run_driver(runner, lens, max_tokens=20)
    # the prompts are prefilled within the first steps; most later steps are decode-only
    assert runner.fast_decode.steps > 20
    for i, p in enumerate(prompts(seed=1, lens=lens)):
        want, logits = hf_greedy(path, p, 20 + i)
        assert_greedy_parity(d.all[f"r{i}"].output, want, logits)


@pytest.mark.parametrize(
    ("quantization", "activations"),
    [("none", "none"), ("int8", "none"), ("int4", "none"), ("int4", "int8")],
)
def test_many_rows_give_the_tokens_of_the_modules(quantization, activations):
    """34 decodes at once (past the row counts where linear_small / linear_q hand over), with
    block size 3: the fast path's tokens are those of transformers' modules on the same weights."""
    path = tiny_model("qwen2")
    lens = tuple(2 + (5 * i) % 13 for i in range(34))
    if activations != "none" and not q8p_built():
        lens = lens[:12]  # linear_q8a only up to QuantLinear.KERNEL_MAX_ROWS: fewer requests
    settings = {"model.quantization": quantization, "model.activation_quantization": activations}
    outputs = []
    for fast in (True, False):
        runner, out = decode_many(path, lens, fast, max_tokens=5, seed=7, **settings)
        assert (runner.fast_decode is not None and runner.fast_decode.steps > 0) is fast
        if fast and activations == "int8" and torch.ops.baton.q8p_kernel():
            # AVX-512 VNNI or AVX2: the linears run linear_q8p on their packed rows at every row count
            # (the 34-row prefill and decode steps too), inside the stack as in the modules
            assert all(p.numel() for p in runner.fast_decode.packed)
            assert runner.fast_decode.packed_max_rows == QuantLinear.PACKED_INT8_MAX_ROWS
        outputs.append(out)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_prefill_and_mixed_steps_of_few_tokens_run_the_stack(quantization, monkeypatch):
    """Prefill chunks and mixed steps of up to STACK_MAX_TOKENS tokens run decode_layers too
    (every token a row attending over its own context, its chunk's keys written first): the
    greedy tokens of transformers' modules on the same weights; longer steps keep the modules."""
    path = tiny_model("qwen2")  # q/k/v biases
    lens = (5, 17, 1, 30, 9, 45, 12)
    outputs, stack_steps = {}, {}
    real, default = FastDecode.step_logits, model_runner.STACK_MAX_TOKENS
    for limit in (default, 20, 0):
        monkeypatch.setattr(model_runner, "STACK_MAX_TOKENS", limit)
        runner = make_runner(
            path, block_size=4, budget=24, max_seqs=8, **{"model.quantization": quantization}
        )
        calls: list[int] = []

        def counted(fast, inputs, calls=calls):
            calls.append(int(inputs.input_ids.shape[0]))
            return real(fast, inputs)

        monkeypatch.setattr(FastDecode, "step_logits", counted)
        d = run_driver(runner, lens, max_tokens=12)
        outputs[limit] = [d.all[f"r{i}"].output for i in range(len(lens))]
        stack_steps[limit] = calls
    assert len(stack_steps[default]) > 5  # every prefill step (<= 24 tokens)
    assert stack_steps[20] and max(stack_steps[20]) <= 20  # the longer ones ran the modules
    assert not stack_steps[0]
    assert outputs[default] == outputs[0] == outputs[20]


def prompt_keys(inputs) -> float | None:
    """The mean keys a step's prompt rows attend over (the rows after its decode rows), or None
    for a step without prompt rows."""
    decodes = sum(g.n for g in inputs.attn.decode_groups)
    prompt = inputs.positions[decodes:] + 1
    return float(prompt.float().mean()) if prompt.numel() else None


def test_prompt_rows_over_long_contexts_keep_the_modules(monkeypatch):
    """A prefill or mixed step whose prompt rows attend over more than STACK_MAX_PROMPT_KEYS keys
    each on average runs transformers' modules (their flash attention reuses the chunk's keys,
    the stack reads them once a row); the others run the stack. The same greedy tokens."""
    path = tiny_model("llama")
    lens = (5, 17, 1, 30, 9, 45, 12)
    real = FastDecode.step_logits
    monkeypatch.setattr(model_runner, "STACK_MAX_PROMPT_KEYS", 12)
    ran: list[float] = []  # the mean keys of the prompt rows of each step the stack ran

    def counted(fast, inputs):
        keys = prompt_keys(inputs)
        ran.append(keys if keys is not None else 0.0)
        return real(fast, inputs)

    monkeypatch.setattr(FastDecode, "step_logits", counted)
    runner = make_runner(path, block_size=4, budget=24, max_seqs=8)
    steps: list[float] = []  # the same for every step with prompt rows
    builder_build = runner.inputs.build

    def build(so, skip=()):
        inputs = builder_build(so, skip)
        keys = prompt_keys(inputs)
        if keys is not None:
            steps.append(keys)
        return inputs

    monkeypatch.setattr(runner.inputs, "build", build)
    d = run_driver(runner, lens, max_tokens=12)
    limited = [d.all[f"r{i}"].output for i in range(len(lens))]
    assert ran and max(ran) <= 12  # the stack ran the short contexts' steps
    assert sum(1 for k in steps if k > 12) > 0  # and left the others to the modules
    assert len(ran) == sum(1 for k in steps if k <= 12)
    monkeypatch.setattr(model_runner, "STACK_MAX_PROMPT_KEYS", 0)
    modules = run_driver(
        make_runner(path, block_size=4, budget=24, max_seqs=8), lens, max_tokens=12
    )
    assert limited == [modules.all[f"r{i}"].output for i in range(len(lens))]


def decode_many(path, lens, fast, max_tokens, seed, **settings):
    """A runner (blocks of 3, every request at once) and the greedy tokens of requests of prompt
    lengths ``lens``, ``max_tokens`` each."""
    runner = make_runner(
        path, block_size=3, budget=512, max_seqs=len(lens), fast_decode=fast, **settings
    )
    d = run_driver(runner, lens, max_tokens, block_size=3, budget=512, seed=seed, grow=0)
    return runner, [d.all[f"r{i}"].output for i in range(len(lens))]


@pytest.mark.parametrize(
    ("arch", "overrides", "reason"),
    [
        ("gemma", {}, "GemmaForCausalLM is not one of"),
        ("qwen3", {}, "Qwen3ForCausalLM is not one of"),
        ("phi3", {}, "Phi3ForCausalLM is not one of"),
        ("mistral", {"sliding_window": 8}, "sliding_window=8"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
            "sliding_window=6",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_refused_for_other_architectures(arch, overrides, reason, caplog):
    with caplog.at_level(logging.DEBUG, logger="baton.worker.fast_decode_build"):
        runner = make_runner(tiny_model(arch, **overrides))
    assert runner.fast_decode is None
    assert reason in caplog.text


def test_refused_when_switched_off_without_kernels_and_for_subclasses(caplog):
    path = tiny_model("llama")
    assert make_runner(path, fast_decode=False).fast_decode is None
    assert make_runner(path, cpu_kernels=False).fast_decode is None

    class Staged(ModelRunner):  # a parallel runner's model is cut or sharded
        def forward(self, inputs):
            return super().forward(inputs)

    from baton.config import BatonConfig

    runner = Staged(runner_settings(BatonConfig.load(model=str(path))), torch.device("cpu"))
    runner.load_model()
    assert runner.fast_decode is None


def test_refused_with_hooks_and_foreign_linears(caplog):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    assert loader.load()
    assert build_fast_decode(model, torch.device("cpu"), kernels=True, max_positions=64) is not None
    assert build_fast_decode(model, torch.device("cpu"), kernels=False, max_positions=64) is None
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    with caplog.at_level(logging.DEBUG, logger="baton.worker.fast_decode_build"):
        assert build_fast_decode(model, torch.device("cpu"), kernels=True, max_positions=64) is None
    assert "model.layers.1.mlp has forward hooks" in caplog.text
    handle.remove()

    class Wrapped(torch.nn.Linear):  # e.g. a LoRA layer: its forward does more
        pass

    model.model.layers[0].self_attn.q_proj.__class__ = Wrapped
    with caplog.at_level(logging.DEBUG, logger="baton.worker.fast_decode_build"):
        assert build_fast_decode(model, torch.device("cpu"), kernels=True, max_positions=64) is None
    assert "layer 0 q_proj is a Wrapped" in caplog.text


def _random_caches(runner, cache_dtype, g):
    """Random (key, value) paged caches per layer of ``runner``'s model, blocks of 4 tokens, the
    key cache in the layout decode_layers reads (head_dim before the block's tokens)."""
    fast = runner.fast_decode
    kv_heads, head_dim = fast.num_kv_heads, runner.kv_caches[0].shape[-1]
    caches = [
        torch.randn((2, NUM_BLOCKS, kv_heads, 4, head_dim), generator=g).to(cache_dtype)
        for _ in range(len(fast.norms) // 2)
    ]
    return [(c[0].view(NUM_BLOCKS, kv_heads, head_dim, 4).clone(), c[1].clone()) for c in caches]


def _stack_call(
    fast,
    caches,
    hidden,
    positions,
    slots,
    table,
    lens,
    head,
    threads,
    shared=False,
    invariant=False,
    part=-1,
):
    """decode_layers on copies of ``caches`` with ``threads`` threads; (output, caches after).
    ``shared``: rows read keys that other rows of the step write (a verify step's drafts);
    ``invariant``: batch-invariant sums, one parallel region at any row count; ``part``: one
    half layer's partial sum or the final norm (a tensor-parallel rank's steps)."""
    k = [c[0].clone() for c in caches]
    v = [c[1].clone() for c in caches]
    with torch_threads(threads):
        out = torch.ops.baton.decode_layers(
            hidden,
            fast.cos_table.index_select(0, positions),
            fast.sin_table.index_select(0, positions),
            fast.norms,
            fast.weights,
            fast.biases,
            fast.qtypes,
            fast.q8a,
            k,
            v,
            slots,
            table,
            lens,
            fast.num_heads,
            fast.num_kv_heads,
            fast.eps,
            fast.scale,
            fast.quant_max_rows,
            fast.float_max_rows,
            *head,
            shared,
            invariant,
            part,
            fast.packed,
            fast.head_packed if head[0] is not None else None,
            fast.packed_max_rows,
        )
    return out, k, v


@pytest.mark.parametrize(
    ("quantization", "activations", "cache_dtype", "packed_exact"),
    [
        ("none", "none", torch.float32, ""),
        ("int4", "none", torch.float32, "0"),
        ("int4", "none", torch.float32, "1"),
        ("int8", "int8", torch.bfloat16, ""),
        ("none", "none", torch.float16, ""),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_one_parallel_region_is_split_independent_and_runs_the_head(
    quantization, activations, cache_dtype, packed_exact, rows, monkeypatch
):
    """Up to the kernels' row limits decode_layers runs in one parallel region, split over the
    threads by rows and (request, kv head) pairs: one thread and two give the same bits, the
    head run inside gives the logits of the head module, and the cache gets the same writes;
    past them (40 rows; packed linears with int8 activations, or exact ones on AMX tiles, still
    within) op by op, as the modules.
    packed_exact: exact linears on ggml's rows (linear_q) or packed ones (linear_qp)."""
    if packed_exact:
        monkeypatch.setenv(PACKED_EXACT_ENV, packed_exact)
    path = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)  # q/k/v biases, GQA
    runner = make_runner(
        path,
        block_size=4,
        budget=64,
        max_seqs=16,
        **{
            "model.quantization": quantization,
            "model.activation_quantization": activations,
            "cache.dtype": str(cache_dtype).removeprefix("torch."),
        },
    )
    fast = runner.fast_decode
    assert fast is not None and fast.cos_table is not None and fast.head_args is not None
    if packed_exact:  # the tiny model's widths fill the packed tiles
        assert all(bool(p.numel()) for p in fast.packed) == (packed_exact == "1" and q8p_built())
    g = torch.Generator().manual_seed(rows)
    hd = fast.norms[0].numel()
    blocks_per = 5
    caches = _random_caches(runner, cache_dtype, g)
    # each request its own blocks, as the KV manager gives them (written slots are never shared)
    table = torch.randperm(NUM_BLOCKS, generator=g)[: rows * blocks_per].view(rows, blocks_per)
    lens = torch.randint(1, blocks_per * 4 + 1, (rows,), generator=g)
    positions = lens - 1
    slots = table.gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    hidden = torch.randn((rows, hd), generator=g)
    head = fast.head_args[:4]
    with torch.inference_mode():
        one, k1, v1 = _stack_call(fast, caches, hidden, positions, slots, table, lens, head, 1)
        two, k2, v2 = _stack_call(fast, caches, hidden, positions, slots, table, lens, head, 2)
        normed, k3, _ = _stack_call(
            fast, caches, hidden, positions, slots, table, lens, (None, -1, 0, None), 2
        )
        by_module = fast.head(normed)
    assert one.shape == (rows, by_module.shape[1])
    assert torch.equal(one, two)
    assert torch.equal(two, by_module)
    for a, b, c in zip(k1, k2, k3, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert all(torch.equal(a, b) for a, b in zip(v1, v2, strict=True))
    # the step wrote its keys: the caches changed at the slots and only there
    changed = (k1[0] != caches[0][0]).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set((slots // 4).tolist()) and changed


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_draft_rows_attend_after_every_row_wrote_its_keys(cache_dtype, threads):
    """A verify step's rows of one request (its last token and drafts: one block table, contexts
    L, L+1, ...) read keys that other rows of the step write, on any thread: with
    shared_context every row's keys are written before any row attends, so the step gives the
    bits of the same step run with every row's keys already in the cache."""
    path = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    runner = make_runner(
        path, block_size=4, budget=64, max_seqs=16, **{"cache.dtype": str(cache_dtype)[6:]}
    )
    fast = runner.fast_decode
    assert fast is not None and fast.head_args is not None
    g = torch.Generator().manual_seed(threads)
    caches = _random_caches(runner, cache_dtype, g)
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[:15].view(3, 5)
    # request 1: 1 row; request 0: 5 rows from context 9 (its drafts cross into a new block, and
    # with two threads its last rows attend on the other thread than its first); request 2: 2 rows
    owner = [1, 0, 0, 0, 0, 0, 2, 2]
    lens = torch.tensor([7, 9, 10, 11, 12, 13, 14, 15])
    table = blocks[owner].contiguous()
    positions = lens - 1
    slots = table.gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    hidden = torch.randn((len(owner), fast.norms[0].numel()), generator=g)
    head = fast.head_args[:4]
    args = (positions, slots, table, lens, head, threads)
    with torch.inference_mode():
        together, k1, v1 = _stack_call(fast, caches, hidden, *args, shared=True)
        written = list(zip(k1, v1, strict=True))
        alone, k2, v2 = _stack_call(fast, written, hidden, *args, shared=False)
    assert torch.equal(together, alone)
    assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k2 + v2, strict=True))


#: widths that are not multiples of the tiles' 64-column blocks (q, k and v 80 each, MLP 100): with
#: two threads the fused q/k/v share splits k at its column 48, inside a packed block
ODD_WIDTHS = {
    "hidden_size": 80,
    "num_attention_heads": 5,
    "num_key_value_heads": 5,
    "intermediate_size": 100,
}


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "op-by-op"])
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2}), ("llama", ODD_WIDTHS)],
    ids=["qwen2-biases-gqa", "llama-odd-widths"],
)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_bfloat16_model_runs_its_linears_as_bf16_gemms_in_the_stack(rows, arch, overrides, tiles):
    """A bfloat16 model's stack (its linears as bf16 GEMMs: oneDNN's brgemm on AMX tiles in one
    parallel region where this CPU has them, else at::linear op by op; everything else in
    float32) gives the logits of the float32 stack on the same bfloat16-valued weights but for
    the rounding of each linear's input to bfloat16: close, not equal, at any row count, biases
    and the head included; one thread and two give the same bits."""
    if tiles and not torch.ops.baton.bf16_tiles():
        pytest.skip("no bfloat16 AMX tiles here (AMX not granted or oneDNN does not pack bf16)")
    path = tiny_model(arch, **overrides)
    kwargs = {"block_size": 4, "budget": 64, "max_seqs": 64}
    bf16 = make_runner(path, **kwargs, **{"model.dtype": "bfloat16"})
    f32 = make_runner(path, **kwargs)
    with torch.no_grad():
        for p in f32.model.parameters():  # the same values as the bfloat16 model's weights
            p.copy_(p.bfloat16().float())
    fast, ref = bf16.fast_decode, f32.fast_decode
    assert fast is not None and ref is not None and fast.head_args is not None
    assert set(fast.qtypes) == {BF16_WEIGHTS} and fast.head_args[1] == BF16_WEIGHTS
    assert all(b.numel() == 0 or b.dtype == torch.float32 for b in fast.biases)
    assert all(p.numel() > 0 for p in fast.packed) == bool(torch.ops.baton.bf16_tiles())
    if not tiles:  # the path of a CPU without tiles
        fast = dataclasses.replace(
            fast, packed=[torch.empty(0)] * len(fast.packed), head_packed=None
        )
    g = torch.Generator().manual_seed(rows)
    caches = _random_caches(f32, torch.bfloat16, g)
    table = torch.randperm(NUM_BLOCKS, generator=g)[: rows * 2].view(rows, 2)
    lens = torch.randint(1, 9, (rows,), generator=g)
    positions = lens - 1
    slots = table.gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    hidden = torch.randn((rows, fast.norms[0].numel()), generator=g)
    args = (caches, hidden, positions, slots, table, lens)
    with torch.inference_mode():
        got, k_got, _ = _stack_call(fast, *args, fast.head_args[:4], 2)
        one, _, _ = _stack_call(fast, *args, fast.head_args[:4], 1)
        want, k_want, _ = _stack_call(ref, *args, ref.head_args[:4], 2)
        unfused, _, _ = _stack_call(fast, *args, (None, -1, 0, None), 2)
    assert got.dtype == torch.float32 and got.shape == want.shape
    if tiles:  # each output column is one brgemm call's, whichever thread makes it
        assert torch.equal(got, one)
    err = float((got - want).abs().max())
    assert 0 < err <= 0.03 * float(want.abs().max()), err
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.9
    # the cache holds the same keys but for that rounding; the head's module reads the stack's
    # output in the model's dtype
    assert all(
        torch.allclose(a.float(), b.float(), atol=0.05) for a, b in zip(k_got, k_want, strict=True)
    )
    by_module = fast.head(unfused.to(torch.bfloat16)).float()
    assert float((by_module - got).abs().max()) <= 0.03 * float(got.abs().max())


def test_a_bfloat16_model_decodes_through_the_stack_the_same_every_run(monkeypatch):
    """Decode-only steps of a bfloat16 model run the stack; its greedy tokens repeat run to run
    and mostly agree with transformers' bfloat16 modules (they round the residual stream too).
    Its prefill and mixed steps keep the modules (their rounding; the stack's is not theirs)."""
    path = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    lens = tuple(2 + (5 * i) % 13 for i in range(12))
    stack_steps: list[int] = []
    real = FastDecode.step_logits

    def counted(fast, inputs):
        stack_steps.append(int(inputs.input_ids.shape[0]))
        return real(fast, inputs)

    monkeypatch.setattr(FastDecode, "step_logits", counted)
    outputs = []
    for fast in (True, True, False):
        runner, out = decode_many(path, lens, fast, 10, seed=3, **{"model.dtype": "bfloat16"})
        assert (runner.fast_decode is not None and runner.fast_decode.steps >= 9) is fast
        outputs.append(out)
    assert outputs[0] == outputs[1]
    assert not stack_steps
    pairs = [(a, b) for x, y in zip(*outputs[::2], strict=True) for a, b in zip(x, y, strict=True)]
    assert sum(a == b for a, b in pairs) >= 0.7 * len(pairs)


def test_batch_invariant_refuses_bfloat16_weights():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.bfloat16)
    assert loader.load()
    assert build_fast_decode(model, torch.device("cpu"), True, 64) is not None
    with pytest.raises(ExecutorError, match="bfloat16 weights"):
        build_fast_decode(model, torch.device("cpu"), True, 64, invariant=True)


#: requests whose sampler reads more of the logits than the argmax
NOT_ARGMAX_ONLY = [
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, logit_bias={7: 3.0}),
    SamplingParams(temperature=0.0, min_tokens=4),
]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_greedy_steps_screen_the_exact_head_with_the_same_tokens(quantization, monkeypatch):
    """A step whose sampler reads only each row's argmax runs the exact packed head screened
    (linear_qp_argmax: -inf where a logit cannot be its row's largest): the tokens of the whole
    head. A step with a request that samples, wants logprobs, penalties, a bias or min_tokens
    runs the whole head."""
    if not q8p_built():
        pytest.skip("linear_qp is not built here (no AVX-512 VNNI, no AVX2)")
    monkeypatch.setenv(PACKED_EXACT_ENV, "1")  # the exact linears (and head) on packed rows
    monkeypatch.setattr(FastDecode, "SCREEN_MIN_ROWS", 1)  # steps of a few rows too
    path = tiny_model("llama")
    lens = (5, 17, 1, 30, 9, 45, 12)
    seen: list[tuple[list[str], bool]] = []
    real = FastDecode._screens

    def recorded(fast, inputs):
        screens = real(fast, inputs)
        seen.append((list(inputs.sample_req_ids), screens))
        return screens

    monkeypatch.setattr(FastDecode, "_screens", recorded)
    settings = {"model.quantization": quantization}
    outputs = []
    for screen in (True, False):
        runner = make_runner(path, block_size=4, budget=24, max_seqs=8, **settings)
        assert runner.fast_decode is not None and runner.fast_decode.head_bounds is not None
        if not screen:
            runner.fast_decode.head_bounds = None
        seen.clear()
        d = run_driver(runner, lens, max_tokens=12)
        outputs.append([d.all[f"r{i}"].output for i in range(len(lens))])
        assert any(s for _, s in seen) is screen
    assert outputs[0] == outputs[1]
    for params in NOT_ARGMAX_ONLY:
        runner = make_runner(path, block_size=4, budget=24, max_seqs=8, **settings)
        seen.clear()
        d = Driver(runner, NUM_BLOCKS, 4, budget=24)
        for i, p in enumerate(prompts(seed=1, lens=(5, 9, 12))):
            special = i == 1  # done after 2 tokens: the others decode on without it
            d.add(f"r{i}", p, max_tokens=2 if special else 6, params=params if special else None)
        d.run()
        with_it = [s for rids, s in seen if "r1" in rids]
        assert with_it and not any(with_it), params
        assert any(s for rids, s in seen if "r1" not in rids)  # the others' steps after it
