"""Several decode steps in one engine step (``scheduler.decode_steps``): when the scheduler asks,
what it reserves and counts, the runner's side, and the same tokens end to end."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from baton import LLM, SamplingParams
from baton.frontend.output_processor import OutputProcessor
from baton.metrics.stats import IterationStats
from baton.protocol import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from baton.request import RequestStatus
from baton.sampling_params import RequestOutputKind, StructuredOutputSpec
from baton.sched.decode_steps import MAX_ROWS
from baton.sched.scheduler import Scheduler
from baton.testing.tiny_model import tiny_model

from .sched_helpers import make_request, make_scheduler

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _prefill(s: Scheduler, *reqs) -> SchedulerOutput:
    """Add ``reqs`` and run their prompt step, each sampling token 100."""
    for r in reqs:
        s.add_request(r)
    so = s.schedule()
    assert so.decode_steps == 1  # a prompt step decodes once
    s.update_from_output(so, _tokens(so, 1))
    return so


def _tokens(so: SchedulerOutput, k: int, first: int = 100) -> ModelRunnerOutput:
    """The runner's output giving each scheduled request ``k`` tokens first, first + 1, ..."""
    rids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=rids, sampled_token_ids=[list(range(first, first + k)) for _ in rids]
    )


def test_a_lone_greedy_decode_runs_several_steps_and_counts_them():
    s = make_scheduler(decode_steps=4, max_model_len=4096)
    req = make_request("a", 6, temperature=0, max_tokens=20)
    _prefill(s, req)
    so = s.schedule()
    assert so.decode_steps == 4 and so.num_scheduled_tokens == {"a": 1}
    # slots for positions 6..9: blocks of 16 hold them already; the computed count is the one token
    assert req.num_computed_tokens == 7
    s.update_from_output(so, _tokens(so, 4, first=200))
    assert req.output_token_ids == [100, 200, 201, 202, 203]
    assert req.num_computed_tokens == 10  # the positions of the three tokens fed back
    so = s.schedule()
    assert so.scheduled_cached_reqs.new_token_ids == [[200, 201, 202, 203]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [10]


def test_slots_cross_into_a_new_block():
    s = make_scheduler(decode_steps=8, max_model_len=4096)
    req = make_request("a", 13, temperature=0, max_tokens=40)
    _prefill(s, req)  # 14 tokens: position 13 decodes next
    held = len(s.kv.req_to_block_ids["a"])
    so = s.schedule()
    assert so.decode_steps == 8  # positions 13..20: one block more
    assert len(so.scheduled_cached_reqs.new_block_ids[0]) == 1
    assert len(s.kv.req_to_block_ids["a"]) == held + 1
    s.update_from_output(so, _tokens(so, 8))
    assert req.num_computed_tokens == 21


def test_steps_are_capped_by_max_tokens_and_max_model_len():
    s = make_scheduler(decode_steps=8, max_model_len=4096)
    req = make_request("a", 6, temperature=0, max_tokens=4)
    _prefill(s, req)  # one output token: three to go
    so = s.schedule()
    assert so.decode_steps == 3
    s.update_from_output(so, _tokens(so, 3))
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(req.output_token_ids) == 4

    s = make_scheduler(decode_steps=8, max_model_len=12)
    req = make_request("b", 6, temperature=0, max_tokens=100, max_model_len=12)
    _prefill(s, req)  # 7 tokens of 12
    assert s.schedule().decode_steps == 5


def test_a_stop_token_inside_the_steps_ends_the_request_there():
    s = make_scheduler(decode_steps=4, max_model_len=4096)
    req = make_request("a", 6, temperature=0, max_tokens=20, stop_token_ids=[201])
    _prefill(s, req)
    so = s.schedule()
    [out] = s.update_from_output(so, _tokens(so, 4, first=200))
    assert out.new_token_ids == [200, 201] and out.stop_reason == 201
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert "a" not in s.requests and s.kv.pool.free_queue.num_free == s.kv.pool.num_blocks - 1


def test_more_tokens_than_steps_fails_that_request_only():
    s = make_scheduler(decode_steps=2, max_model_len=4096)
    a = make_request("a", 6, temperature=0, max_tokens=20)
    b = make_request("b", 7, temperature=0, max_tokens=20)
    _prefill(s, a, b)
    so = s.schedule()
    assert so.decode_steps == 2
    out = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[1, 2, 3], [4, 5]])
    by_id = {o.request_id: o for o in s.update_from_output(so, out)}
    assert by_id["a"].error and "3 tokens for a step of 2 decode step(s)" in by_id["a"].error
    assert by_id["b"].new_token_ids == [4, 5] and b.num_computed_tokens == 9


def test_a_runner_that_returns_one_token_is_fine():
    s = make_scheduler(decode_steps=4, max_model_len=4096)
    req = make_request("a", 6, temperature=0, max_tokens=20)
    _prefill(s, req)
    so = s.schedule()
    s.update_from_output(so, _tokens(so, 1))
    assert req.num_computed_tokens == 7 and len(req.output_token_ids) == 2


class _AnyGrammar:
    """A compiled grammar that takes every token."""

    def accept_tokens(self, tokens: list[int]) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize(
    "why",
    [
        "off",
        "sampled",
        "logprobs",
        "penalty",
        "min_tokens",
        "logit_bias",
        "waiting",
        "too_many",
        "grammar",
    ],
)
def test_one_step_when_a_request_reads_more_than_the_argmax_or_one_waits(why):
    s = make_scheduler(decode_steps=1 if why == "off" else 4, max_model_len=4096)
    params = {
        "sampled": dict(temperature=0.7, seed=3),
        "logprobs": dict(temperature=0, logprobs=2),
        "penalty": dict(temperature=0, repetition_penalty=1.2),
        "min_tokens": dict(temperature=0, min_tokens=2),
        "logit_bias": dict(temperature=0, logit_bias={5: 1.0}),
    }.get(why, dict(temperature=0))
    n = MAX_ROWS + 1 if why == "too_many" else 2
    reqs = [make_request(f"r{i}", 5 + i, max_tokens=20, **params) for i in range(n)]
    if why == "grammar":
        reqs[0].sampling_params = SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=StructuredOutputSpec(regex="a+")
        )
        assert not reqs[0].sampling_params.argmax_only
        reqs[0].sampling_params = SamplingParams(temperature=0, max_tokens=20)
        reqs[0].grammar = _AnyGrammar()  # compiled: the request samples under it
    _prefill(s, *reqs)
    if why == "waiting":
        s.add_request(make_request("late", 300, temperature=0, max_tokens=4))
    so = s.schedule()
    assert so.decode_steps == 1


def test_blocks_short_of_the_steps_give_one_step_and_no_preemption():
    s = make_scheduler(num_blocks=4, decode_steps=8, max_model_len=4096)  # 3 blocks of 16
    a = make_request("a", 14, temperature=0, max_tokens=30)
    c = make_request("c", 14, temperature=0, max_tokens=30)
    _prefill(s, a, c)  # a block each; positions 14.. need a second block each, one is free
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "c": 1}
    assert so.decode_steps == 1 and s.total_preemptions == 0
    s.update_from_output(so, _tokens(so, 1))
    assert a.num_computed_tokens == c.num_computed_tokens == 15


# ------------------------------------------------------------------ the engine


PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(100, 141)), [77] * 3]


def _decode_steps_of(llm: LLM) -> list[int]:
    """The list each later step's ``decode_steps`` goes to (the engine core runs in-process)."""
    steps: list[int] = []
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule

    def counting() -> SchedulerOutput:
        so = schedule()
        steps.append(so.decode_steps)
        return so

    scheduler.schedule = counting
    return steps


def _greedy(llm: LLM, **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fast-decode", "modules"])
def test_the_engine_gives_the_same_tokens(cpu_kernels):
    path = str(tiny_model("llama"))
    got = {}
    for k in (1, 4, 7):
        with LLM(
            model=path,
            block_size=4,
            **{"scheduler.decode_steps": k, "executor.cpu_kernels": cpu_kernels},
        ) as llm:
            steps = _decode_steps_of(llm)
            batch = _greedy(llm)
            alone = [
                list(
                    llm.generate(
                        {"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
                        use_tqdm=False,
                    )[0]
                    .outputs[0]
                    .token_ids
                )
                for p in PROMPTS
            ]
            # a prefix-cache hit on blocks written in several decode steps: the same tokens
            again = _greedy(llm)
            stop_at = batch[0][9]
            stopped = llm.generate(
                {"prompt_token_ids": PROMPTS[0]},
                SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop_at]),
                use_tqdm=False,
            )[0].outputs[0]
            # a stop string that ends inside a step of several decode steps
            stop_str = llm.tokenizer.decode(batch[2][9:11])
            by_str = llm.generate(
                {"prompt_token_ids": PROMPTS[2]},
                SamplingParams(temperature=0, max_tokens=23, stop=[stop_str]),
                use_tqdm=False,
            )[0].outputs[0]
            assert by_str.finish_reason == "stop" and len(by_str.token_ids) < 23
            # a continuation that hits blocks written in decode steps
            longer = PROMPTS[1] + batch[1][:20]
            cont = llm.generate(
                {"prompt_token_ids": longer},
                SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                use_tqdm=False,
            )[0]
            assert cont.num_cached_tokens >= len(PROMPTS[1]) + 16  # 4-token blocks of output
            got[k] = (
                batch,
                alone,
                again,
                list(stopped.token_ids),
                list(cont.outputs[0].token_ids),
                (by_str.text, list(by_str.token_ids)),
            )
            assert (max(steps) > 1) == (k > 1)
            if k > 1:
                assert max(steps) == k
    assert got[4] == got[1] and got[7] == got[1]
    batch, alone, again, stopped, _, _ = got[1]
    assert batch == alone == again
    assert stopped == batch[0][: batch[0].index(batch[0][9]) + 1]


def test_a_sampled_companion_keeps_every_step_single():
    path = str(tiny_model("qwen2"))
    with LLM(model=path, block_size=4, **{"scheduler.decode_steps": 4}) as llm:
        steps = _decode_steps_of(llm)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS[:2]],
            [
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
            ],
            use_tqdm=False,
        )
        assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
        assert max(steps) == 1


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_several_tokens_at_once_stop_where_one_at_a_time_would(kind):
    """A stop string completed by a token inside an output of several (decode steps,
    speculation): the tokens after it are not the output's, nor counted."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    ids = tokenizer.encode(" one two three four five six", add_special_tokens=False)
    sp = SamplingParams(stop=[" three"], output_kind=kind, logprobs=0)

    def run(chunks: list[list[int]]) -> tuple[list[int], str, int]:
        proc = OutputProcessor(tokenizer)
        proc.add_request("r", "x", [5], sp, 0.0)
        stats = IterationStats(timestamp=0.0)
        tokens, text = [], ""
        for chunk in chunks:
            lps = [TokenLogprobs(token_ids=[t], logprobs=[-1.0], sampled_rank=1) for t in chunk]
            out = EngineCoreOutput(request_id="r", new_token_ids=chunk, new_logprobs=lps)
            [ro] = proc.process_outputs([out], stats).request_outputs
            c = ro.outputs[0]
            tokens = (
                tokens + list(c.token_ids) if kind == RequestOutputKind.DELTA else list(c.token_ids)
            )
            text = text + c.text if kind == RequestOutputKind.DELTA else c.text
            assert len(c.logprobs or ()) == len(c.token_ids) or kind == RequestOutputKind.DELTA
            if ro.finished:
                assert c.finish_reason == "stop" and c.stop_reason == " three"
                return tokens, text, stats.num_generation_tokens
        raise AssertionError("no stop")

    one_by_one = run([[t] for t in ids])
    assert one_by_one == run([ids[:2], ids[2:6]]) == run([ids])
    assert one_by_one[1] == " one two" and one_by_one[2] == len(one_by_one[0])
