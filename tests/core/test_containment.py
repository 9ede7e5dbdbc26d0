"""Containment: a fault attributable to one request fails that request alone.

Faults are injected for one request of a batch at each place a step can raise
(preparation, sampling, the scheduler's update, the grammar bitmask, output
processing), plus the real values that used to kill the engine, fed past any
front validation. The faulty request ends with finish reason "error" and the
message; the others keep exactly the tokens of a run without it; the engine
serves the next request. A fault in the forward pass still fails the engine.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.errors import ExecutorError
from baton.frontend.detokenizer import IncrementalDetokenizer
from baton.frontend.output_processor import OutputProcessor
from baton.protocol import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    GrammarOutput,
    KVCacheConfig,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from baton.request import Request, RequestStatus
from baton.sampling_params import RequestOutputKind, StructuredOutputSpec
from baton.serial import MsgpackDecoder, MsgpackEncoder
from baton.testing.tiny_model import tiny_model
from baton.worker.input_batch import InputBatch
from baton.worker.model_runner import ModelRunner
from baton.worker.sampler import Sampler, SamplingMetadata
from baton.worker.worker import runner_settings
from tests.core.sched_helpers import make_request, make_scheduler

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The seed that marks the faulty request for the injected faults.
MAGIC = 911_001
MAX_LEN = 256
BUDGET = 64  # a prompt longer than this is prefilled in chunks
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
GOOD = [("The weather today is", GREEDY), ("1 2 3 4", SEEDED)]
BAD_PROMPT = "Tell me a story about a cat"


def bad_params(**extra) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=MAGIC, max_tokens=12, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def llm():
    with LLM(
        model=str(tiny_model("llama")), max_model_len=MAX_LEN, max_num_batched_tokens=BUDGET
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    outs = llm.generate([p for p, _ in GOOD], [sp for _, sp in GOOD], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_with_bad(llm, reference, bad_sp: SamplingParams, message: str) -> None:
    """The faulty request between the good ones: it alone fails; the engine goes on."""
    (good0, sp0), (good1, sp1) = GOOD
    outs = llm.generate([good0, BAD_PROMPT, good1], [sp0, bad_sp, sp1], use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.error is not None and bad.error.startswith(message), bad.error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == reference
    assert not llm.engine.core.scheduler.requests  # nothing left behind
    llm.engine.core.check_health()
    again = llm.generate([p for p, _ in GOOD], [sp for _, sp in GOOD], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference


# ---------------------------------------------------------------- injected faults, one per place


def test_preparation_fault_fails_one_request(llm, reference, monkeypatch):
    set_sampling = InputBatch._set_sampling

    def faulty(self, row, sp, eos):
        if sp.seed == MAGIC:
            raise OverflowError("injected preparation fault")
        set_sampling(self, row, sp, eos)

    monkeypatch.setattr(InputBatch, "_set_sampling", faulty)
    run_with_bad(llm, reference, bad_params(), "OverflowError: injected preparation fault")


def test_sampling_fault_fails_one_row(llm, reference, monkeypatch):
    call = Sampler.__call__
    calls: list[int] = []

    def faulty(self, logits, md):
        calls.append(logits.shape[0])
        if any(s is not None and s[0] == MAGIC for s in md.seeds):
            raise RuntimeError("injected sampling fault")
        return call(self, logits, md)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    run_with_bad(llm, reference, bad_params(), "RuntimeError: injected sampling fault")
    assert 3 in calls and calls.count(1) >= 3  # the batch failed, then each row alone


def test_scheduler_update_fault_fails_one_request(llm, reference, monkeypatch):
    from baton.sched import step_update

    check = step_update.append_and_check_stop

    def faulty(req, new, max_model_len):
        if req.sampling_params.seed == MAGIC:
            raise ValueError("injected stop-check fault")
        return check(req, new, max_model_len)

    monkeypatch.setattr(step_update, "append_and_check_stop", faulty)
    run_with_bad(llm, reference, bad_params(), "ValueError: injected stop-check fault")


def test_grammar_bitmask_fault_fails_one_request(llm, reference, monkeypatch):
    backend = pytest.importorskip("baton_xgrammar.backend")

    def faulty(self, bitmask, row):
        raise RuntimeError("injected bitmask fault")

    monkeypatch.setattr(backend.XGrammarMatcher, "fill_bitmask", faulty)
    spec = StructuredOutputSpec(choice=["yes", "no"])
    run_with_bad(
        llm, reference, bad_params(structured_outputs=spec), "RuntimeError: injected bitmask fault"
    )


def test_output_processing_fault_fails_one_request_and_aborts_it(llm, reference, monkeypatch):
    update = IncrementalDetokenizer.update
    marker = "<<fail here>>"

    def faulty(self, new_token_ids):
        if marker in self._stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return update(self, new_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty)
    # run_with_bad checks that the engine dropped it (no request left in the scheduler)
    run_with_bad(llm, reference, bad_params(stop=[marker]), "UnicodeDecodeError: ")


# ---------------------------------------------------------------- the real values, past validation


def _core_request(rid: str, prompt: list[int], sp: SamplingParams) -> Request:
    """A Request put straight into the scheduler: no frontend or EngineCore.add_request check."""
    return Request(rid, prompt, sp, eos_token_id=2, max_model_len=MAX_LEN)


def _drive(core: EngineCore) -> dict[str, EngineCoreOutput]:
    """Step until idle; each request's tokens gathered into its last output."""
    done: dict[str, EngineCoreOutput] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        if not core.has_work():
            break
        outs, _ = core.step_fn()
        for o in outs.outputs if outs else ():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                o.new_token_ids = tokens[o.request_id]
                done[o.request_id] = o
    assert not core.has_work()
    return done


def _unchecked(**params) -> SamplingParams:
    """SamplingParams holding values front validation refuses (set after construction)."""
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    for k, v in params.items():
        setattr(sp, k, v)
    return sp


def test_values_that_killed_the_engine_fail_only_their_request(llm):
    core = llm.engine.core
    prompt = list(range(100, 120))
    long_prompt = list(range(300, 300 + 2 * BUDGET + 5))  # fails in its first, mid-prompt, chunk

    def add_good() -> None:
        core.scheduler.add_request(
            _core_request("g", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        )
        core.scheduler.add_request(
            _core_request(
                "s",
                prompt[:7],
                SamplingParams(temperature=1, seed=3, max_tokens=8, ignore_eos=True),
            )
        )

    core.reset_prefix_cache()  # every run computes its prompts afresh
    add_good()
    want = _drive(core)
    core.reset_prefix_cache()
    add_good()
    core.scheduler.add_request(
        _core_request("top_k", prompt, _unchecked(temperature=1.0, top_k=10**20))
    )
    core.scheduler.add_request(
        _core_request("top_k_long", long_prompt, _unchecked(temperature=1.0, top_k=10**20))
    )
    core.scheduler.add_request(
        _core_request(
            "ban", prompt, _unchecked(temperature=0.0, min_tokens=2, stop_token_ids=[10**6])
        )
    )
    got = _drive(core)
    for rid, error in (
        ("top_k", "OverflowError: "),
        ("top_k_long", "OverflowError: "),
        ("ban", "IndexError: "),
    ):
        assert got[rid].finish_reason == FinishReason.ERROR and got[rid].error.startswith(error), (
            got[rid]
        )
        assert got[rid].new_token_ids == []
    for rid in ("g", "s"):
        assert got[rid].new_token_ids == want[rid].new_token_ids and got[rid].error is None
    core.check_health()  # the executor did not fail
    assert not core.scheduler.requests
    core.reset_prefix_cache()
    add_good()
    assert {k: v.new_token_ids for k, v in _drive(core).items()} == {
        k: v.new_token_ids for k, v in want.items()
    }


# ---------------------------------------------------------------- the model runner, by hand


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = BatonConfig.load(
        model=str(tiny_model("llama")), block_size=4, max_num_batched_tokens=64, max_num_seqs=8
    )
    r = ModelRunner(runner_settings(cfg), torch.device("cpu"))
    r.load_model()
    r.initialize_kv_cache(KVCacheConfig(num_blocks=128, block_size=4))
    return r


def _new(rid: str, prompt: list[int], blocks: list[int], sp: SamplingParams) -> NewRequestData:
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sp,
        block_ids=blocks,
        num_computed_tokens=0,
    )


def _step(
    runner: ModelRunner, reqs: list[NewRequestData], finished=(), so_ids=()
) -> ModelRunnerOutput:
    so = SchedulerOutput(
        scheduled_new_reqs=reqs,
        num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in reqs},
        total_num_scheduled_tokens=sum(len(r.prompt_token_ids) for r in reqs),
        finished_req_ids=list(finished),
        structured_output_req_ids=list(so_ids),
    )
    out = runner.execute_model(so)
    return out if out is not None else runner.sample_tokens(None)


GOOD_REQS = [
    ("a", [5, 6, 7, 8, 9], [0, 1], SamplingParams(temperature=0)),
    ("b", [11, 12, 13], [2], SamplingParams(temperature=1.0, seed=5, top_k=20)),
    ("c", [21, 22, 23, 24], [3], SamplingParams(temperature=0, presence_penalty=0.5, logprobs=2)),
]


def _good() -> list[NewRequestData]:
    return [_new(*r) for r in GOOD_REQS]


def _tokens(out: ModelRunnerOutput) -> dict[str, list[int]]:
    return dict(zip(out.req_ids, out.sampled_token_ids, strict=True))


def test_runner_preparation_failure_leaves_no_row(runner):
    want = _step(runner, _good())
    _step(runner, [], finished=[r[0] for r in GOOD_REQS])
    bad = _new("bad", [31, 32], [9], _unchecked(temperature=1.0, top_k=10**20))
    reqs = _good()
    out = _step(runner, [reqs[0], bad, *reqs[1:]])
    assert set(out.failed) == {"bad"} and out.failed["bad"].startswith("OverflowError: ")
    assert _tokens(out) == _tokens(want) and out.logprobs == want.logprobs
    assert "bad" not in runner.input_batch.req_id_to_index and runner.input_batch.num_reqs == 3
    # the scheduler finishes it: its removal is a no-op; the others stay in place
    assert _step(runner, [], finished=["bad", *(r[0] for r in GOOD_REQS)]).failed is None
    assert runner.input_batch.num_reqs == 0


def test_runner_sampling_failure_samples_the_others_alone(runner):
    want = _step(runner, _good())
    _step(runner, [], finished=[r[0] for r in GOOD_REQS])
    ban = _new(
        "ban", [31, 32], [9], _unchecked(temperature=0.0, min_tokens=2, stop_token_ids=[10**6])
    )
    reqs = _good()
    out = _step(runner, [ban, *reqs])
    assert set(out.failed) == {"ban"} and out.failed["ban"].startswith("IndexError: ")
    assert _tokens(out) == _tokens(want) and out.logprobs == want.logprobs
    _step(runner, [], finished=["ban", *(r[0] for r in GOOD_REQS)])


def test_runner_every_request_failing_skips_the_forward(runner, monkeypatch):
    def no_forward(*_):
        raise AssertionError("the forward ran for no request")

    monkeypatch.setattr(runner, "forward", no_forward)
    bad = _new("bad", [31, 32], [9], _unchecked(temperature=1.0, top_k=10**20))
    out = _step(runner, [bad])
    assert out.req_ids == [] and set(out.failed) == {"bad"}
    # a structured step still answers through sample_tokens, with the failure
    bad2 = _new("bad2", [31, 32], [9], _unchecked(temperature=1.0, top_k=10**20))
    so = SchedulerOutput(
        scheduled_new_reqs=[bad2],
        num_scheduled_tokens={"bad2": 2},
        total_num_scheduled_tokens=2,
        structured_output_req_ids=["bad2"],
    )
    assert runner.execute_model(so) is None
    out = runner.sample_tokens(
        GrammarOutput(req_ids=["bad2"], bitmask=np.zeros((1, 1536), np.int32))
    )
    assert set(out.failed) == {"bad2"}
    assert runner.input_batch.num_reqs == 0


def test_runner_cached_update_failure_drops_the_row(runner):
    _step(runner, _good())
    so = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["a", "b"],
            new_token_ids=[[1], [7]],
            new_block_ids=[[], [10**30]],  # b: a block id that does not fit the block table
            num_computed_tokens=[5, 3],
        ),
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
    )
    out = runner.execute_model(so)
    assert set(out.failed) == {"b"} and out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1
    assert "b" not in runner.input_batch.req_id_to_index
    _step(runner, [], finished=["a", "b", "c"])


def test_sampler_restores_penalised_logits_when_it_raises(monkeypatch):
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(2, 50)
    before = logits.clone()
    md = SamplingMetadata(
        all_greedy=True,
        penalty_rows=torch.tensor([1]),
        prompt_ids=torch.tensor([[3, 4]]),
        output_ids=torch.tensor([[5]]),
        repetition_penalty=torch.tensor([1.5]),
        presence_penalty=torch.tensor([2.0]),
        min_tokens_bans=[(0, [7])],
    )

    def boom(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(Sampler, "_sample", boom)
    with pytest.raises(RuntimeError):
        sampler(logits, md)
    before[0, 7] = float("-inf")  # the ban stays: applying it again changes nothing
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- scheduler and protocol


def test_scheduler_finishes_runner_failures_also_mid_prompt_chunk():
    sched = make_scheduler(max_num_batched_tokens=32, block_size=16, enable_prefix_caching=True)
    free = sched.kv.num_free_blocks
    long = make_request("long", 80)  # 3 chunks
    short = make_request("short", 10)
    sched.add_request(long)
    sched.add_request(short)
    so = sched.schedule()
    assert so.num_scheduled_tokens["long"] == 32
    out = ModelRunnerOutput(failed={"long": "OverflowError: too big"})
    outs = {o.request_id: o for o in sched.update_from_output(so, out)}
    assert outs["long"].finish_reason == FinishReason.ERROR
    assert outs["long"].error == "OverflowError: too big"
    assert long.status == RequestStatus.FINISHED_ERROR and "long" not in sched.requests
    # its unwritten blocks were never registered in the prefix cache
    again = make_request("again", long.prompt_token_ids)
    sched.finish_requests(["short"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == free
    sched.add_request(again)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert "long" in so.finished_req_ids  # the runner is told; its removal there is a no-op


def test_scheduler_update_fault_fails_only_that_request(monkeypatch):
    from baton.sched import step_update

    sched = make_scheduler()
    for rid in ("x", "y"):
        sched.add_request(make_request(rid, 5, max_tokens=4))
    so = sched.schedule()
    check = step_update.append_and_check_stop

    def faulty(req, new, max_model_len):
        if req.request_id == "x":
            raise KeyError("injected")
        return check(req, new, max_model_len)

    monkeypatch.setattr(step_update, "append_and_check_stop", faulty)
    out = ModelRunnerOutput(req_ids=["x", "y"], sampled_token_ids=[[7], [8]])
    outs = {o.request_id: o for o in sched.update_from_output(so, out)}
    assert (
        outs["x"].finish_reason == FinishReason.ERROR and outs["x"].error == "KeyError: 'injected'"
    )
    assert outs["y"].new_token_ids == [8] and outs["y"].finish_reason is None
    assert list(sched.requests) == ["y"]


def test_model_runner_output_failed_crosses_the_wire():
    out = ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[[1]], failed={"b": "OverflowError: x"}
    )
    enc, dec = MsgpackEncoder(), MsgpackDecoder(ModelRunnerOutput)
    assert dec.decode(enc.encode(out)) == out
    old = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[1]])  # an older peer: no field
    assert dec.decode(enc.encode(old)).failed is None


# ---------------------------------------------------------------- the output processor, n > 1


def test_a_failed_child_reports_its_error_on_the_joined_output(llm):
    proc = OutputProcessor(llm.get_tokenizer())
    from baton.frontend.output_processor import split_request

    sp = SamplingParams(n=2, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    for rid, index, p, parent in split_request("p", sp):
        proc.add_request(rid, "x", [5], p, 0.0, index=index, parent=parent)
    err = EngineCoreOutput(
        request_id="0_p",
        new_token_ids=[],
        finish_reason=FinishReason.ERROR,
        error="IndexError: bad",
    )
    assert proc.process_outputs([err]).request_outputs == []  # the sibling still runs
    ok = EngineCoreOutput(request_id="1_p", new_token_ids=[42], finish_reason=FinishReason.LENGTH)
    [ro] = proc.process_outputs([ok]).request_outputs
    assert ro.finished and ro.error == "IndexError: bad"
    assert [c.finish_reason for c in ro.outputs] == ["error", "length"]


# ---------------------------------------------------------------- what still fails the engine


def test_a_forward_fault_still_fails_the_engine(monkeypatch):
    config = BatonConfig.load(model=str(tiny_model("llama")), max_model_len=MAX_LEN)
    core = EngineCore(config)
    try:

        def broken(self, inputs):
            raise RuntimeError("device lost")

        monkeypatch.setattr(ModelRunner, "forward", broken)
        core.add_request(
            EngineCoreRequest(request_id="r", prompt_token_ids=[5, 6, 7], sampling_params=GREEDY)
        )
        with pytest.raises(ExecutorError, match="device lost"):
            core.step_fn()
        with pytest.raises(ExecutorError, match="failed earlier"):
            core.step_fn()
    finally:
        core.shutdown()
