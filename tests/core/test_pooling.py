"""Pooling requests (embeddings) through the engine: the numbers of transformers' hidden states.

A pooling request runs in the scheduler's and the runner's steps with generation: its
prompt is prefilled (in chunks when the budget says so) and its final hidden states
pooled. These tests compare with transformers' own forward of the tiny model (last
token, mean, first token, normalised or not), over chunked prefill, prefix-cache hits,
mixed batches and preemption-free restarts, and check what is refused and why.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from baton import LLM, AsyncLLM, SamplingParams
from baton.errors import InvalidRequestError
from baton.pooling_params import PoolingParams
from baton.protocol import SchedulerOutput
from baton.testing.tiny_model import tiny_model
from baton.worker.pooler import Pooler, Span

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: a prompt longer than the step budget below: it is prefilled in three chunks
LONG = [(7 * i + 3) % 40000 + 100 for i in range(37)]
SHORT = [11, 12, 13, 14, 15]
BUDGET = 16
ATOL = 1e-4

_refs: dict[str, torch.nn.Module] = {}


def hidden(path, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of ``ids``: [tokens, hidden]."""
    from transformers import AutoModel

    key = str(path)
    if key not in _refs:
        _refs[key] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _refs[key](torch.tensor([ids])).last_hidden_state[0]


def want(path, ids: list[int], kind: str, normalize: bool = True) -> torch.Tensor:
    h = hidden(path, ids)
    vec = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


@pytest.fixture(scope="module")
def path():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(path):
    with LLM(
        model=str(path), max_model_len=128, max_num_batched_tokens=BUDGET, block_size=4
    ) as engine:
        yield engine


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_pooled_vectors_match_transformers_over_chunks(llm, path, kind, normalize):
    params = PoolingParams(pooling_type=kind, normalize=normalize)
    outs = llm.embed([LONG, SHORT, [42]], params, use_tqdm=False)
    for out, ids in zip(outs, [LONG, SHORT, [42]], strict=True):
        assert out.finished and out.error is None
        got = out.outputs.data
        assert got.dtype == torch.float32 and got.shape == (64,)
        torch.testing.assert_close(got, want(path, ids, kind, normalize), atol=ATOL, rtol=0)
        if normalize:
            assert abs(float(got.norm()) - 1.0) < 1e-5


def test_the_config_default_is_last_token_normalized(llm, path):
    [out] = llm.embed(LONG, use_tqdm=False)
    torch.testing.assert_close(out.outputs.data, want(path, LONG, "last"), atol=ATOL, rtol=0)
    assert out.outputs.embedding == pytest.approx(out.outputs.data.tolist())


def test_mean_pooling_set_in_the_config(path):
    with LLM(model=str(path), max_model_len=64, pooling_type="mean", pooling_normalize=False) as e:
        [out] = e.embed(SHORT, use_tqdm=False)
    torch.testing.assert_close(
        out.outputs.data, want(path, SHORT, "mean", normalize=False), atol=ATOL, rtol=0
    )


def test_pooling_and_generation_share_steps_without_changing_each_other(llm, path):
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate([SHORT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    # the engine interleaves: a pooling request prefilled while the other decodes
    seen: list = []
    llm.output_processor.add_request("gen", None, SHORT, greedy, 0.0, sink=seen.append)
    llm.engine.add_request(_engine_request(llm, "gen", SHORT, greedy))
    [pooled] = llm.embed([LONG], PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert not seen[-1].finished  # the pooling request finished while this one decoded
    while not seen[-1].finished:
        llm.output_processor.process_outputs(llm.engine.get_output().outputs)
    assert seen[-1].outputs[0].token_ids == alone
    torch.testing.assert_close(pooled.outputs.data, want(path, LONG, "mean"), atol=ATOL, rtol=0)


def _engine_request(llm, rid, ids, params):
    info = llm.input_processor.validate(ids, params)
    return llm.input_processor.process(rid, ids, params, scheduling=info)


def test_prefix_cache_hits_serve_last_token_pooling_but_not_mean(llm, path):
    ids = [*LONG[:32], 999]  # 33 tokens: 8 full blocks of 4 cached after the first request
    first, second = llm.embed([ids], use_tqdm=False), llm.embed([ids], use_tqdm=False)
    assert second[0].num_cached_tokens == 32  # only the last token computed
    for out in (*first, *second):
        torch.testing.assert_close(out.outputs.data, want(path, ids, "last"), atol=ATOL, rtol=0)
    [mean] = llm.embed([ids], PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert mean.num_cached_tokens == 0  # every token's hidden state is needed
    torch.testing.assert_close(mean.outputs.data, want(path, ids, "mean"), atol=ATOL, rtol=0)
    # and the blocks a pooling request computed serve later generation as a prefix
    out = llm.generate([[*ids[:-1], 5]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].num_cached_tokens == 32


def test_dimensions_are_refused_on_a_model_not_trained_for_them(llm):
    with pytest.raises(InvalidRequestError, match="dimensions=8") as e:
        llm.embed(SHORT, PoolingParams(dimensions=8), use_tqdm=False)
    assert e.value.param == "dimensions"


def test_dimensions_cut_a_matryoshka_models_vector_before_normalizing():
    path = tiny_model("llama", matryoshka_dimensions=[16, 32])
    with LLM(model=str(path), max_model_len=64) as e:
        [out] = e.embed(SHORT, PoolingParams(dimensions=16), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="one of \\[16, 32\\]"):
            e.embed(SHORT, PoolingParams(dimensions=8), use_tqdm=False)
    vec = hidden(path, SHORT)[-1][:16]
    torch.testing.assert_close(
        out.outputs.data, torch.nn.functional.normalize(vec, dim=0), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(pooling_type="max"), "pooling_type"),
        (dict(dimensions=0), "dimensions"),
        (dict(normalize="yes"), "normalize"),
    ],
)
def test_bad_pooling_params_name_their_field(params, field):
    with pytest.raises(InvalidRequestError) as e:
        PoolingParams(**params)
    assert e.value.param == field and field in str(e.value)


def test_async_encode_yields_one_final_output(path):
    async def main():
        llm = await AsyncLLM.create(model=str(path), max_model_len=128)
        try:
            gen = llm.generate(SHORT, SamplingParams(temperature=0.0, max_tokens=4))
            pooled = [o async for o in llm.encode(LONG, PoolingParams(pooling_type="mean"))]
            tokens = [o async for o in gen]
            return pooled, tokens
        finally:
            llm.shutdown()

    pooled, tokens = asyncio.run(main())
    assert len(pooled) == 1 and pooled[0].finished
    torch.testing.assert_close(pooled[0].outputs.data, want(path, LONG, "mean"), atol=ATOL, rtol=0)
    assert tokens[-1].finished and len(tokens[-1].outputs[0].token_ids) == 4


def test_a_mean_chunk_that_skips_tokens_fails_that_request_alone():
    pooler = Pooler("mean", True)
    so = SchedulerOutput(scheduled_new_reqs=[_new("a", PoolingParams()), _new("b")])
    pooler.update(so)
    pooler._hidden = torch.ones(6, 4)
    done, failed = pooler.pool([Span("a", 0, 3, 4, 7)])  # starts at 4: positions 0..3 unseen
    assert done == {} and "starts at position 4 after 0" in failed["a"]
    assert "a" not in pooler.requests and "b" not in pooler.requests  # b does not pool


def _new(rid, params=None):
    from baton.protocol import NewRequestData

    return NewRequestData(
        req_id=rid,
        prompt_token_ids=[1] * 7,
        sampling_params=SamplingParams(),
        block_ids=[],
        num_computed_tokens=0,
        pooling_params=params,
    )


def _pooling_request(rid: str, n: int, kind: str = "last"):
    from baton.request import Request

    return Request(
        rid,
        list(range(1, n + 1)),
        SamplingParams(max_tokens=1),
        pooling_params=PoolingParams(pooling_type=kind, normalize=True),
    )


def test_the_scheduler_finishes_a_pooling_request_after_its_prompt_chunks():
    from baton.protocol import FinishReason, ModelRunnerOutput

    from .sched_helpers import make_scheduler

    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    sched.add_request(_pooling_request("p", 12, "mean"))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"p": 8}
    assert so.scheduled_new_reqs[0].pooling_params.pooling_type == "mean"
    assert (
        sched.update_from_output(so, ModelRunnerOutput(req_ids=["p"], sampled_token_ids=[[]])) == []
    )
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"p": 4}
    vec = torch.ones(3)
    [out] = sched.update_from_output(
        so, ModelRunnerOutput(req_ids=["p"], sampled_token_ids=[[]], pooler_output={"p": vec})
    )
    assert out.finish_reason == FinishReason.STOP and out.new_token_ids == []
    assert out.pooling_output is vec
    view = sched.kv.view()  # nothing kept: its blocks are free (and cached for later prompts)
    assert not sched.requests and not view.req_block_ids
    assert view.num_free_blocks == view.num_usable_blocks and len(view.block_hashes) == 3


def test_a_pooling_request_the_runner_returns_nothing_for_fails_alone():
    from baton.protocol import FinishReason, ModelRunnerOutput

    from .sched_helpers import make_scheduler

    sched = make_scheduler()
    sched.add_request(_pooling_request("p", 5))
    so = sched.schedule()
    [out] = sched.update_from_output(so, ModelRunnerOutput(req_ids=["p"], sampled_token_ids=[[]]))
    assert out.finish_reason == FinishReason.ERROR
    assert "no pooled output for request 'p'" in out.error


def test_a_pooled_vector_crosses_the_process_boundary_as_a_frame():
    from baton.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from baton.serial import MsgpackDecoder, MsgpackEncoder

    vec = torch.linspace(-1, 1, 1024)
    out = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                request_id="p",
                new_token_ids=[],
                finish_reason=FinishReason.STOP,
                pooling_output=vec,
            )
        ]
    )
    frames = MsgpackEncoder().encode(out)
    assert len(frames) == 2  # the body and the vector's own frame
    back = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert torch.equal(back.outputs[0].pooling_output, vec)


# ---------------------------------------------------------------- base models without a head


@pytest.fixture(scope="module")
def bert():
    """A tiny random BertModel with the SmolLM2 tokenizer (its vocabulary size)."""
    return tiny_model("bert", max_position_embeddings=64)


def test_an_encoder_pools_in_batched_steps_as_transformers_computes(bert, caplog):
    prompts = [list(range(100, 100 + n)) for n in (5, 20, 40)]  # 65 tokens: two steps
    with LLM(model=str(bert), max_model_len=64, max_num_batched_tokens=48) as llm:
        assert (llm.info.runner_type, llm.info.pooling_type) == ("pooling", "cls")
        # bidirectional: each prompt computed whole, never from a cached prefix
        assert "disabling enable_chunked_prefill, enable_prefix_caching: BertModel" in caplog.text
        cls = llm.embed(prompts, use_tqdm=False)
        mean = llm.embed(prompts, PoolingParams(pooling_type="mean"), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="no language-model head") as e:
            llm.generate(prompts[0], use_tqdm=False)
        assert e.value.param == "model"
    for ids, c, m in zip(prompts, cls, mean, strict=True):
        torch.testing.assert_close(c.outputs.data, want(bert, ids, "cls"), atol=ATOL, rtol=0)
        torch.testing.assert_close(m.outputs.data, want(bert, ids, "mean"), atol=ATOL, rtol=0)


def test_the_engine_core_refuses_generation_on_an_encoder(bert):
    with LLM(model=str(bert), max_model_len=64) as llm:
        req = llm.input_processor.process(
            "g",
            [5, 6],
            SamplingParams(max_tokens=1),
            scheduling=llm.input_processor.validate([5, 6], SamplingParams(max_tokens=1)),
        )
        with pytest.raises(InvalidRequestError, match="cannot generate text"):
            llm.engine.add_request(req)


def test_a_sentence_transformers_pooling_config_sets_the_default(bert, tmp_path):
    import json
    import shutil

    from baton.model_info import read_model_info

    folder = tmp_path / "st"
    shutil.copytree(bert, folder)
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True})
    )
    assert read_model_info(folder, 64).pooling_type == "mean"
    with LLM(model=str(folder), max_model_len=64) as llm:
        [out] = llm.embed(SHORT, use_tqdm=False)
    torch.testing.assert_close(out.outputs.data, want(bert, SHORT, "mean"), atol=ATOL, rtol=0)


def test_the_runner_restarts_a_preempted_mean_from_its_first_token(path):
    """A request preempted mid-prompt comes back as new: its partial sum is dropped, not doubled."""
    from baton.config import BatonConfig
    from baton.protocol import CachedRequestData, KVCacheConfig, NewRequestData
    from baton.worker.model_runner import ModelRunner
    from baton.worker.worker import runner_settings

    cfg = BatonConfig.load(model=str(path), block_size=4, max_num_batched_tokens=16)
    runner = ModelRunner(runner_settings(cfg), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(KVCacheConfig(num_blocks=32, block_size=4))
    prompt = LONG[:12]
    params = PoolingParams(pooling_type="mean", normalize=True)

    def new(blocks):
        return NewRequestData(
            req_id="p",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1),
            block_ids=blocks,
            num_computed_tokens=0,
            pooling_params=params,
        )

    def step(i, n, **kw):
        return runner.execute_model(
            SchedulerOutput(
                step_id=i, num_scheduled_tokens={"p": n}, total_num_scheduled_tokens=n, **kw
            )
        )

    assert step(1, 8, scheduled_new_reqs=[new([1, 2, 3])]).pooler_output is None
    # preempted after its first chunk; admitted again (other blocks) from its first token
    assert (
        step(2, 8, preempted_req_ids=["p"], scheduled_new_reqs=[new([4, 5, 6])]).pooler_output
        is None
    )
    cached = CachedRequestData(
        req_ids=["p"], new_token_ids=[[]], new_block_ids=[[]], num_computed_tokens=[8]
    )
    out = step(3, 4, scheduled_cached_reqs=cached)
    assert out.sampled_token_ids == [[]] and not out.failed
    torch.testing.assert_close(
        out.pooler_output["p"], want(path, prompt, "mean"), atol=ATOL, rtol=0
    )
    assert "p" not in runner.pooler.requests
