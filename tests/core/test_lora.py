"""LoRA adapters: PEFT folders read by baton, several adapters and the base model in one batch.

A tiny random Llama and random PEFT adapters made with peft (B not zero): greedy tokens and
logits equal transformers + peft with the adapter merged; a batch mixing two adapters and
requests without one equals each request alone; the native decode stack (fast_decode) is left
for steps with an adapter; add / remove / list / pin through LLM and AsyncLLM (its engine in its
own process: the calls cross the wire); the prefix cache keeps adapters apart.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from baton import LLM, AsyncLLM, SamplingParams
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.errors import ConfigError, InvalidRequestError
from baton.kv.hashing import root_hash
from baton.lora import LoRARequest
from baton.lora.adapter import load_adapter, read_adapter_config
from baton.protocol import EngineCoreRequest
from baton.testing.tiny_model import tiny_model

from .lora_helpers import adapter, merged_model

pytest.importorskip("peft")

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def loras(model: str) -> dict[str, LoRARequest]:
    """Two adapters: every linear at rank 8; q/v only at rank 4 with rsLoRA and an alpha pattern."""
    a = adapter(model, seed=1, r=8, alpha=16)
    b = adapter(
        model,
        seed=2,
        r=4,
        alpha=8,
        targets=("q_proj", "v_proj"),
        use_rslora=True,
        alpha_pattern={"v_proj": 2.0},
    )
    return {"a": LoRARequest("a", 1, a), "b": LoRARequest("b", 2, b)}


#: A small LoRA engine on CPU: what the tests that start their own engine share.
SMALL_ENGINE = dict(
    device="cpu", num_threads=1, max_model_len=256, kv_cache_memory=4 << 20, enable_lora=True
)


@pytest.fixture(scope="module")
def llm(model: str):
    with LLM(
        model=model,
        device="cpu",
        num_threads=1,
        max_model_len=512,
        kv_cache_memory=16 << 20,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
    ) as llm:
        yield llm


def runner_of(llm: LLM):
    return llm.engine.core.executor.worker.model_runner


def greedy(llm: LLM, prompts: list[list[int]], loras) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        GREEDY,
        use_tqdm=False,
        lora_request=loras,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", ["a", "b"])
def test_greedy_tokens_and_logits_match_transformers_with_the_adapter_merged(
    llm, model, loras, name
):
    lora = loras[name]
    prompt = ids(5, 37)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=lora)[
        0
    ].outputs[0]
    ref = merged_model(model, lora.lora_path)
    hf = ref.generate(
        torch.tensor([prompt]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert list(out.token_ids) == hf.sequences[0, len(prompt) :].tolist()
    want = torch.log_softmax(torch.stack(hf.logits)[:, 0], dim=-1)
    for step, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert abs(lps[tok].logprob - float(want[step, tok])) < 1e-4
        for t, lp in lps.items():
            assert abs(lp.logprob - float(want[step, t])) < 1e-4
    base = greedy(llm, [prompt], None)[0]
    assert base != list(out.token_ids), "the adapter changes nothing: a useless test"


def test_a_batch_mixing_two_adapters_and_no_adapter_equals_each_request_alone(llm, loras):
    a, b = loras["a"], loras["b"]
    prompts = [ids(10 + i, n) for i, n in enumerate((3, 40, 17, 25, 9, 60, 33))]
    which = [None, a, b, a, None, b, a]
    alone = [greedy(llm, [p], [w])[0] for p, w in zip(prompts, which, strict=True)]
    batch = greedy(llm, prompts, which)
    assert batch == alone
    assert len({tuple(t) for t in alone[:3]}) == 3


@pytest.mark.usefixtures("cpu_kernel_ops")  # fast_decode needs baton's kernels
def test_steps_with_an_adapter_leave_the_native_decode_stack(llm, loras):
    """The tiny Llama decodes through fast_decode's native layer stack, which has no LoRA: a
    step with an adapter runs transformers' modules instead, a step without one still takes it."""
    fast = runner_of(llm).fast_decode
    assert fast is not None, "fast_decode should apply to the tiny Llama"
    prompt = ids(3, 20)
    before = fast.steps
    with_adapter = greedy(llm, [prompt, prompt], [loras["a"], None])
    assert fast.steps == before, "a step with an adapter went through the native stack"
    base = greedy(llm, [prompt], None)
    assert fast.steps >= before + MAX_TOKENS - 2
    assert with_adapter[1] == base[0]


def test_the_prefix_cache_keeps_adapters_apart(llm, loras):
    a, b = loras["a"], loras["b"]
    assert root_hash(None, "1") != root_hash(None, "2") != root_hash(None)
    assert root_hash("s", "1") != root_hash("s") and root_hash("s", None) == root_hash("s")
    prompt = {"prompt_token_ids": ids(77, 70)}  # 4 full blocks of 16
    once = SamplingParams(temperature=0, max_tokens=1)
    assert llm.reset_prefix_cache()

    def cached(lora) -> int:
        return llm.generate(prompt, once, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0, "adapter b reused adapter a's KV"
    assert cached(None) == 0, "the base model reused an adapter's KV"
    assert cached(a) == 64 and cached(b) == 64 and cached(None) == 64


def test_add_remove_list_pin_through_llm(llm, model, loras, tmp_path):
    a, b = loras["a"], loras["b"]
    for lid in llm.list_loras():
        llm.remove_lora(lid)
    assert llm.list_loras() == []
    assert llm.add_lora(a) is True and llm.add_lora(a) is False
    with pytest.raises(InvalidRequestError, match="needs an id of its own"):
        llm.add_lora(LoRARequest("other", 1, b.lora_path))
    assert llm.pin_lora(1) is True
    with pytest.raises(InvalidRequestError, match="not loaded"):
        llm.pin_lora(9)
    # max_cpu_loras=3: a 4th adapter drops the least recently used one that is not pinned
    c = LoRARequest("c", 3, b.lora_path)
    d = LoRARequest("d", 4, a.lora_path)
    assert llm.add_lora(b) and llm.add_lora(c) and llm.list_loras() == [1, 2, 3]
    assert llm.add_lora(d) and llm.list_loras() == [1, 3, 4]
    # a request naming an adapter that is not loaded loads it
    greedy(llm, [ids(1, 5)], b)
    assert 2 in llm.list_loras() and 1 in llm.list_loras()
    assert llm.remove_lora(2) is True and llm.remove_lora(2) is False
    assert 2 not in llm.list_loras()
    assert llm.remove_lora(1) is True  # pinned, but removable on purpose
    # bad adapters are refused by name; the engine goes on
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        llm.add_lora(LoRARequest("bad", 7, str(bad)))
    wide = adapter(model, seed=3, r=32, alpha=32, targets=("q_proj",))
    with pytest.raises(InvalidRequestError, match="max_lora_rank"):
        llm.generate("x", GREEDY, use_tqdm=False, lora_request=LoRARequest("wide", 8, wide))
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        llm.add_lora(LoRARequest("zero", 0, a.lora_path))
    assert greedy(llm, [ids(2, 6)], a)  # still serving


def test_sleep_keeps_the_adapters(llm, loras):
    prompt = ids(8, 30)
    before = greedy(llm, [prompt, prompt], [loras["a"], loras["b"]])
    llm.sleep(2)  # the weights go too: the layers are wrapped again on waking
    llm.wake_up()
    assert greedy(llm, [prompt, prompt], [loras["a"], loras["b"]]) == before


def test_max_loras_keeps_a_step_to_its_slots(model, loras, monkeypatch):
    """max_loras=1: requests with two adapters never share a step; each gets its own tokens."""
    config = BatonConfig.load(
        model=model,
        **SMALL_ENGINE,
        max_loras=1,
    )
    core = EngineCore(config)
    try:
        lora_model = core.executor.worker.model_runner.lora
        seen: list[int] = []
        prepare = lora_model.prepare

        def spy(token_ids):
            seen.append(0 if token_ids is None else len(set(token_ids.tolist()) - {0}))
            prepare(token_ids)

        monkeypatch.setattr(lora_model, "prepare", spy)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, lora in enumerate((loras["a"], loras["b"], None, loras["a"])):
            core.add_request(
                EngineCoreRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=ids(i, 10),
                    sampling_params=params,
                    eos_token_id=2,
                    lora_request=lora,
                )
            )
        done = 0
        while done < 4:
            out, _ = core.step_fn()
            done += sum(1 for o in (out.outputs if out else ()) if o.finished)
        assert max(seen) == 1 and len(seen) > 6
        core.add_request(
            EngineCoreRequest(
                request_id="busy",
                prompt_token_ids=ids(9, 10),
                sampling_params=params,
                eos_token_id=2,
                lora_request=loras["b"],
            )
        )
        with pytest.raises(InvalidRequestError, match="used by 1 unfinished"):
            core.remove_lora(2)
    finally:
        core.shutdown()


def test_speculative_decoding_with_adapters_gives_the_same_tokens(model, loras, llm):
    prompt = [7, 8, 9, 10] * 6  # repeats: the ngram speculator proposes
    want = greedy(llm, [prompt, prompt], [loras["a"], None])
    with LLM(
        model=model,
        **SMALL_ENGINE,
        speculative={"method": "ngram", "num_tokens": 3},
    ) as spec:
        assert greedy(spec, [prompt, prompt], [loras["a"], None]) == want


def test_async_llm(model, loras, llm):
    """AsyncLLM's utility calls and requests with adapters (what crosses a transport: the codec
    test below)."""
    a, b = loras["a"], loras["b"]
    prompt = ids(21, 14)
    want = greedy(llm, [prompt, prompt], [a, b])

    async def main() -> None:
        engine = await AsyncLLM.create(
            model=model,
            **SMALL_ENGINE,
            max_loras=2,
        )
        try:
            assert await engine.add_lora(a) is True
            assert await engine.add_lora(a) is False
            assert await engine.pin_lora(1) is True
            assert await engine.list_loras() == [1]

            async def run(lora) -> list[int]:
                async for out in engine.generate(
                    {"prompt_token_ids": prompt}, GREEDY, lora_request=lora
                ):
                    last = out
                return list(last.outputs[0].token_ids)

            got = await asyncio.gather(run(a), run(b))
            assert list(got) == want
            assert await engine.list_loras() == [1, 2]
            assert await engine.remove_lora(2) is True
            with pytest.raises(InvalidRequestError, match="no such folder"):
                await engine.add_lora(LoRARequest("gone", 5, "/nonexistent/adapter"))
            assert await engine.list_loras() == [1]
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_adapters_cross_the_wire_as_the_engine_takes_them(loras):
    """A LoRARequest in a utility call's arguments arrives as a list of its fields, which the
    engine's add_lora takes; one in an EngineCoreRequest arrives as itself."""
    from baton.lora import as_lora_request
    from baton.protocol import UtilityRequest
    from baton.serial import MsgpackDecoder, MsgpackEncoder

    a = loras["a"]
    call = MsgpackDecoder(UtilityRequest).decode(
        MsgpackEncoder().encode(UtilityRequest(call_id=1, method="add_lora", args=[a]))
    )
    assert as_lora_request(call.args[0]) == a
    req = EngineCoreRequest(
        request_id="x", prompt_token_ids=[1], sampling_params=GREEDY, lora_request=a
    )
    assert MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req)).lora_request == a
    with pytest.raises(InvalidRequestError, match="lora_request"):
        as_lora_request(["a", "one", "/x"])


def test_lora_off_and_model_parallel_are_refused(model, loras):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        BatonConfig.load(model=model, enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        BatonConfig.load(model=model, enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        BatonConfig.load(model=model, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="enable_lora"):
        BatonConfig.load(model=model, **{"server.lora_modules": {"x": "/y"}})
    with LLM(model=model, device="cpu", max_model_len=128, kv_cache_memory=2 << 20) as off:
        with pytest.raises(InvalidRequestError, match="LoRA adapters are off"):
            off.generate("hi", GREEDY, use_tqdm=False, lora_request=loras["a"])
        with pytest.raises(InvalidRequestError, match="LoRA adapters are off"):
            off.add_lora(loras["a"])
        with pytest.raises(InvalidRequestError, match="LoRA adapters are off"):
            off.engine.call_utility("add_lora", loras["a"])  # the engine refuses too


def _folder(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config})
    )
    return folder


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"r": 64}, "max_lora_rank=16"),
    ],
)
def test_adapter_configs_baton_cannot_run_are_refused_by_name(tmp_path, config, error):
    folder = _folder(tmp_path, **config)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(InvalidRequestError, match=error):
        read_adapter_config(folder, max_lora_rank=16)


def test_adapter_weights_are_read_without_peft(tmp_path):
    from safetensors.torch import save_file

    folder = _folder(tmp_path)
    with pytest.raises(InvalidRequestError, match="save it with safe_serialization"):
        (folder / "adapter_model.bin").write_bytes(b"x")
        read_adapter_config(folder)
    a, b = torch.randn(4, 64), torch.randn(128, 4)
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    save_file(
        {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b},
        folder / "adapter_model.safetensors",
    )
    weights = load_adapter(folder)
    got_a, got_b = weights.modules["model.layers.0.mlp.up_proj"]
    assert torch.equal(got_a, a) and torch.allclose(got_b, b * 2.0)  # lora_alpha / r = 8 / 4
    save_file({"base_model.model.lm_head.lora_A.weight": a}, folder / "adapter_model.safetensors")
    with pytest.raises(InvalidRequestError, match="lm_head"):
        load_adapter(folder)


@pytest.mark.parametrize("base", ["linear", "small-batch", "int8"])
def test_the_batched_update_is_each_tokens_own_adapter(base, request):
    """One adapted layer, three adapters in three slots, tokens of slots 0 and 2 and tokens
    without an adapter in one call: each row gets base(x) + its own adapter's x @ A^T @ B^T
    (ranks padded to the slot width, the slot between them masked out), over a plain, a
    small-batch (baton's kernel) and a quantized (int8, GGUF blocks) linear."""
    import numpy as np

    from baton.kernels.cpu_linear import SmallBatchLinear
    from baton.lora.adapter import AdapterConfig, AdapterWeights
    from baton.lora.model import LoRAModel
    from baton.quant.linear import QuantLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True)
    if base == "small-batch":
        request.getfixturevalue("cpu_kernel_ops")  # its kernel
        linear.__class__ = SmallBatchLinear
    elif base == "int8":
        linear = QuantLinear.from_linear(linear, "int8")
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.model.layers[0].self_attn = torch.nn.Module()
    root.model.layers[0].self_attn.q_proj = linear
    lora = LoRAModel(root, torch.device("cpu"), torch.float32, max_loras=3, max_rank=8)
    name = "model.layers.0.self_attn.q_proj"
    factors = {}
    for lid, rank in ((1, 8), (2, 3), (3, 5)):
        a, b = torch.randn(rank, 64), torch.randn(96, rank)
        factors[lid] = (a, b)
        lora.adapters[lid] = AdapterWeights(AdapterConfig(r=rank, lora_alpha=rank), {name: (a, b)})
        lora.requests[lid] = LoRARequest(f"l{lid}", lid, "/x")
    lora.prepare(np.array([1, 2, 3]))  # slots 0, 1, 2
    lora.end_step()
    for ids in ([1, 0, 3, 3, 0, 1], [3, 3, 1, 1]):  # with and without tokens lacking an adapter
        x = torch.randn(len(ids), 64)
        want = linear(x)
        for i, lid in enumerate(ids):
            if lid:
                a, b = factors[lid]
                want[i] += x[i] @ a.T @ b.T
        lora.prepare(np.array(ids))
        got = root.model.layers[0].self_attn.q_proj(x)
        lora.end_step()
        assert lora.span == (0, 24)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a slot freed by remove() and taken by an adapter that does not adapt this layer: the old
    # factors must not linger there (another adapter of the step keeps the layer active)
    assert lora.remove(2)
    lora.adapters[4] = AdapterWeights(AdapterConfig(r=4, lora_alpha=4), {})
    lora.requests[4] = LoRARequest("l4", 4, "/x")
    x = torch.randn(2, 64)
    a, b = factors[1]
    want = linear(x)
    want[1] += x[1] @ a.T @ b.T
    lora.prepare(np.array([4, 1]))
    assert lora.slots[1] == 4
    torch.testing.assert_close(root.model.layers[0].self_attn.q_proj(x), want, rtol=1e-4, atol=1e-4)


def test_data_parallel_engines_load_the_adapters_their_requests_name(model, loras, llm):
    a, b = loras["a"], loras["b"]
    prompts = [ids(30 + i, 12) for i in range(4)]
    which = [a, b, None, a]
    want = greedy(llm, prompts, which)

    async def main() -> list[list[int]]:
        engine = await AsyncLLM.create(
            model=model,
            **SMALL_ENGINE,
            max_loras=2,
            data_parallel_size=2,
            routing={"router": "round-robin"},
        )
        try:
            with pytest.raises(InvalidRequestError, match="one engine of 2"):
                await engine.add_lora(a)

            async def run(p, lora) -> list[int]:
                async for out in engine.generate(
                    {"prompt_token_ids": p}, GREEDY, lora_request=lora
                ):
                    last = out
                return list(last.outputs[0].token_ids)

            return list(
                await asyncio.gather(*(run(p, w) for p, w in zip(prompts, which, strict=True)))
            )
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == want
