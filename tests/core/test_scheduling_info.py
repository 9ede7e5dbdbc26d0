"""Request metadata for policies: SchedulingInfo from the API to ``Request.scheduling``, its
checks (baton.validation), the wire format, and the policy's ``finished`` event."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from baton import LLM, AsyncLLM, SamplingParams, SchedulingInfo
from baton.engine.core import EngineCore
from baton.errors import InvalidRequestError
from baton.interfaces import FinishAwarePolicy, SchedulerPolicy
from baton.protocol import EngineCoreRequest, ModelInfo
from baton.request import Request, RequestStatus
from baton.sampling_params import StructuredOutputSpec
from baton.sched.policies import FCFSPolicy
from baton.sched.scheduler import Scheduler
from baton.scheduling_info import (
    MAX_DEADLINE_S,
    MAX_TAG_KEY_CHARS,
    MAX_TAG_VALUE_CHARS,
    MAX_TAGS,
    MAX_TENANT_CHARS,
    as_scheduling_info,
)
from baton.serial import MsgpackDecoder, MsgpackEncoder
from baton.testing import FakeExecutor
from baton.testing.sched_harness import SchedulerDriver
from baton.testing.tiny_model import tiny_model
from baton.validation import check_request, check_scheduling
from tests.core.sched_helpers import make_config, make_request

INFO = ModelInfo(
    path="fake", architecture="Fake", vocab_size=1000, max_model_len=64, eos_token_ids=[0]
)

# ------------------------------------------------------------------ the checks


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (dict(deadline=0), "scheduling.deadline", "(0, "),
        (dict(deadline=-1.5), "scheduling.deadline", "-1.5"),
        (dict(deadline=float("nan")), "scheduling.deadline", "nan"),
        (dict(deadline=float("inf")), "scheduling.deadline", "inf"),
        (dict(deadline=MAX_DEADLINE_S * 2), "scheduling.deadline", "seconds after"),
        (dict(deadline="5"), "scheduling.deadline", "'5'"),
        (dict(deadline=True), "scheduling.deadline", "True"),
        (dict(tenant=""), "scheduling.tenant", "1 to"),
        (dict(tenant="t" * (MAX_TENANT_CHARS + 1)), "scheduling.tenant", f"{MAX_TENANT_CHARS}"),
        (dict(tenant=7), "scheduling.tenant", "must be a string"),
        (dict(tags={f"k{i}": "v" for i in range(MAX_TAGS + 1)}), "scheduling.tags", "17 entries"),
        (
            dict(tags={"k" * (MAX_TAG_KEY_CHARS + 1): "v"}),
            "scheduling.tags",
            "a key of scheduling.tags",
        ),
        (dict(tags={"": "v"}), "scheduling.tags", "a key of scheduling.tags must have 1 to"),
        (
            dict(tags={"k": "v" * (MAX_TAG_VALUE_CHARS + 1)}),
            "scheduling.tags",
            "scheduling.tags['k']",
        ),
        (dict(tags={"k": 3}), "scheduling.tags", "scheduling.tags['k'] must be a string"),
        (dict(tags={5: "v"}), "scheduling.tags", "a key of scheduling.tags must be a string"),
        (dict(tags=["a", "b"]), "scheduling.tags", "mapping"),
        (dict(priority=2**63), "scheduling.priority", "int64"),
        (dict(priority=1.5), "scheduling.priority", "integer"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(fields, param, words):
    with pytest.raises(InvalidRequestError) as e:
        check_scheduling(SchedulingInfo(**fields))
    assert e.value.param == param
    assert words in str(e.value) and param in str(e.value)
    # the one request check runs it too
    with pytest.raises(InvalidRequestError) as e2:
        check_request(
            [1, 2], SamplingParams(max_tokens=4), INFO, scheduling=SchedulingInfo(**fields)
        )
    assert e2.value.param == param


def test_bounds_are_inclusive():
    check_scheduling(
        SchedulingInfo(
            priority=-(2**63),
            deadline=MAX_DEADLINE_S,
            tenant="t" * MAX_TENANT_CHARS,
            tags={f"{i:0{MAX_TAG_KEY_CHARS}d}": "v" * MAX_TAG_VALUE_CHARS for i in range(MAX_TAGS)},
        )
    )
    check_scheduling(SchedulingInfo(deadline=1, tags={"flag": ""}))  # an int deadline, empty value


def test_mapping_and_priority_merge():
    assert as_scheduling_info(None) == SchedulingInfo()
    assert as_scheduling_info({"deadline": 2.5, "tenant": "a"}, 3) == SchedulingInfo(
        priority=3, deadline=2.5, tenant="a"
    )
    info = SchedulingInfo(priority=4)
    assert as_scheduling_info(info, 0) is info and as_scheduling_info(info, 4) is info
    with pytest.raises(InvalidRequestError, match="disagree") as e:
        as_scheduling_info(info, 5)
    assert e.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="no field 'deadline_s'") as e:
        as_scheduling_info({"deadline_s": 1})
    assert e.value.param == "scheduling.deadline_s"
    for key in (None, 3, "x" * 1000):
        with pytest.raises(InvalidRequestError, match="scheduling has no field") as e:
            as_scheduling_info({key: 1})
        assert e.value.param == "scheduling" and len(str(e.value)) < 200
    with pytest.raises(InvalidRequestError, match="got list") as e:
        as_scheduling_info([1, 2])
    assert e.value.param == "scheduling"
    with pytest.raises(InvalidRequestError) as e:
        as_scheduling_info(None, "high")
    assert e.value.param == "priority"
    # the engine's check: the request's priority and its scheduling's must agree
    with pytest.raises(InvalidRequestError, match="disagree") as e:
        check_request([1], SamplingParams(max_tokens=4), INFO, priority=1, scheduling=info)
    assert e.value.param == "priority"


# ------------------------------------------------------------------ the wire and the Request


def test_engine_core_request_carries_it_and_old_frames_still_decode():
    info = SchedulingInfo(priority=2, deadline=1.5, tenant="acme", tags={"tier": "gold"})
    req = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling_params=SamplingParams(max_tokens=3),
        priority=2,
        scheduling=info,
    )
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
    back = dec.decode(enc.encode(req))
    assert back.scheduling == info
    # a frame from a client that predates the field: the array cut before it (fields added
    # after it, e.g. pooling_params, are absent from such a frame too)
    arr = msgspec.msgpack.decode(enc.encode(req)[0])
    at = EngineCoreRequest.__struct_fields__.index("scheduling")
    assert arr[at] == msgspec.msgpack.decode(msgspec.msgpack.encode(info))
    old = dec.decode([msgspec.msgpack.encode(arr[:at])])
    assert old.scheduling is None and old.priority == 2 and old.request_id == "r"


def test_request_sees_scheduling_and_an_absolute_deadline():
    req = Request.from_engine_core_request(
        EngineCoreRequest(
            request_id="r",
            prompt_token_ids=[1, 2],
            sampling_params=SamplingParams(max_tokens=3),
            arrival_time=100.0,
            priority=1,
            scheduling=SchedulingInfo(priority=1, deadline=2.5, tenant="acme"),
        )
    )
    assert req.deadline_time == 102.5 and req.scheduling.tenant == "acme" and req.priority == 1
    plain = make_request("p", 4, priority=3, arrival=7.0)
    assert plain.scheduling == SchedulingInfo(priority=3) and plain.deadline_time is None
    merged = Request("m", [1], SamplingParams(), scheduling=SchedulingInfo(priority=4))
    assert merged.priority == 4


# ------------------------------------------------------------------ the finished event


class Recording(FCFSPolicy):
    """FCFS that records its finished events and checks the request left it first."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, RequestStatus]] = []

    def finished(self, request: Request) -> None:
        assert request.status.finished
        assert all(r is not request for r in self), "told before the request left the policy"
        self.events.append((request.request_id, request.status))


def _scheduler(policy, **cfg) -> Scheduler:
    config = make_config(**cfg)
    return Scheduler(config.scheduler, config.cache, policy, 64, max_model_len=4096)


def test_finished_once_for_every_reason():
    policy = Recording()
    assert isinstance(policy, SchedulerPolicy) and isinstance(policy, FinishAwarePolicy)
    s = _scheduler(policy, max_num_seqs=2)
    d = SchedulerDriver(s)
    length = make_request("length", 8, max_tokens=3, ignore_eos=True)
    stop_token = d.executor.next_token(length.prompt_token_ids, 8)  # the fake's first token
    stop = make_request("stop", list(length.prompt_token_ids), max_tokens=9, eos=stop_token)
    running = make_request("abort-running", 8, max_tokens=50, ignore_eos=True)
    waiting = make_request("abort-waiting", 8, max_tokens=50, ignore_eos=True)
    failing = make_request("error", 8, max_tokens=50, ignore_eos=True)
    d.add(length, stop)
    d.run()
    assert sorted(policy.events) == [
        ("length", RequestStatus.FINISHED_LENGTH_CAPPED),
        ("stop", RequestStatus.FINISHED_STOPPED),
    ]
    policy.events.clear()
    d.add(running, failing, waiting)  # two seats: "abort-waiting" waits
    d.step()
    s.finish_requests(
        ["abort-running", "abort-waiting", "abort-waiting"], RequestStatus.FINISHED_ABORTED
    )
    so = s.schedule()
    mro = d.executor.execute_model(so)
    mro = msgspec.structs.replace(mro, failed={"error": "RuntimeError: injected"})
    d.record(s.update_from_output(so, mro))
    assert policy.events == [
        ("abort-running", RequestStatus.FINISHED_ABORTED),
        ("abort-waiting", RequestStatus.FINISHED_ABORTED),
        ("error", RequestStatus.FINISHED_ERROR),
    ]
    s.finish_requests(["error", "abort-running", "nobody"], RequestStatus.FINISHED_ABORTED)
    assert len(policy.events) == 3, "a finished request must not be told twice"


def test_a_request_whose_grammar_never_compiled_is_not_reported():
    policy = Recording()
    s = _scheduler(policy)
    r = make_request("g", 10, structured_outputs=StructuredOutputSpec(regex="a+"))
    r.status = RequestStatus.WAITING_FOR_FSM
    s.add_request(r)
    s.finish_requests(["g"], RequestStatus.FINISHED_ABORTED)
    assert policy.events == []


def test_a_policy_without_finished_runs_and_one_that_raises_fails_the_step():
    d = SchedulerDriver(_scheduler(FCFSPolicy()))
    d.add(make_request("a", 8, max_tokens=2, ignore_eos=True))
    d.run()
    assert d.final_outputs["a"].finish_reason is not None

    class Raising(FCFSPolicy):
        def finished(self, request):
            raise KeyError("policy bug")

    d = SchedulerDriver(_scheduler(Raising()))
    d.add(make_request("b", 8, max_tokens=1, ignore_eos=True))
    with pytest.raises(KeyError, match="policy bug"):
        d.run()


# ------------------------------------------------------------------ from the APIs


def test_engine_core_gives_the_policy_what_the_request_carried():
    policy_seen: dict[str, Request] = {}
    config = make_config(max_model_len=64)
    core = EngineCore(config, executor=FakeExecutor(block_size=config.cache.block_size), info=INFO)
    add = core.scheduler.policy.add

    def spy(request):
        policy_seen[request.request_id] = request
        add(request)

    core.scheduler.policy.add = spy
    info = SchedulingInfo(priority=-1, deadline=0.5, tenant="acme", tags={"tier": "gold"})
    core.add_request(
        EngineCoreRequest(
            request_id="r",
            prompt_token_ids=[5, 6, 7],
            sampling_params=SamplingParams(max_tokens=2),
            arrival_time=10.0,
            priority=-1,
            scheduling=info,
        )
    )
    seen = policy_seen["r"]
    assert seen.scheduling == info and seen.deadline_time == 10.5 and seen.priority == -1
    with pytest.raises(InvalidRequestError) as e:  # a client without a frontend is checked too
        core.add_request(
            EngineCoreRequest(
                request_id="bad",
                prompt_token_ids=[5],
                sampling_params=SamplingParams(max_tokens=2),
                scheduling=SchedulingInfo(tags={"k": 1}),  # type: ignore[dict-item]
            )
        )
    assert e.value.param == "scheduling.tags"
    core.shutdown()


@pytest.fixture(scope="module")
def llm():
    with LLM(model=str(tiny_model("llama")), max_model_len=128) as engine:
        yield engine


def _spy_policy(llm, monkeypatch) -> list[Request]:
    seen: list[Request] = []
    policy = llm.engine.core.scheduler.policy
    add = policy.add
    monkeypatch.setattr(policy, "add", lambda r: (seen.append(r), add(r))[1])
    return seen


def test_llm_generate_passes_scheduling_per_prompt(llm, monkeypatch):
    seen = _spy_policy(llm, monkeypatch)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    outs = llm.generate(
        ["one", "two"],
        params,
        priority=[0, 7],
        scheduling=[
            {"deadline": 3.0, "tenant": "a", "tags": {"k": "v"}},
            SchedulingInfo(tenant="b"),
        ],
        use_tqdm=False,
    )
    assert all(o.finished for o in outs)
    by_tenant = {r.scheduling.tenant: r for r in seen}
    assert by_tenant["a"].scheduling == SchedulingInfo(deadline=3.0, tenant="a", tags={"k": "v"})
    assert by_tenant["a"].deadline_time == pytest.approx(by_tenant["a"].arrival_time + 3.0)
    assert by_tenant["b"].priority == 7 and by_tenant["b"].scheduling.priority == 7
    seen.clear()
    llm.chat(
        [{"role": "user", "content": "hi"}], params, scheduling={"tenant": "c"}, use_tqdm=False
    )
    assert [r.scheduling.tenant for r in seen] == ["c"]


def test_llm_refuses_bad_scheduling_before_anything_runs(llm, monkeypatch):
    seen = _spy_policy(llm, monkeypatch)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["a", "b"], scheduling=[{}, {"deadline": -1}], use_tqdm=False)
    assert e.value.param == "scheduling.deadline"
    with pytest.raises(InvalidRequestError, match="disagree"):
        llm.generate("a", priority=[1], scheduling={"priority": 2}, use_tqdm=False)
    assert seen == [], "nothing reaches the engine when one prompt is refused"


def test_async_llm_sends_scheduling_to_the_engine():
    async def main() -> None:
        llm = await AsyncLLM.create(model=str(tiny_model("llama")), max_model_len=128)
        sent: list[EngineCoreRequest] = []
        add = llm.engine.add_request_async

        async def spy(req):
            sent.append(req)
            await add(req)

        llm.engine.add_request_async = spy
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            async for _ in llm.generate("hi", params, priority=2, scheduling={"tenant": "t"}):
                pass
            async for _ in llm.generate("hi", params, priority=3):
                pass
            with pytest.raises(InvalidRequestError) as e:
                async for _ in llm.generate("hi", params, scheduling={"tags": {"x": 5}}):
                    pass
            assert e.value.param == "scheduling.tags"
        finally:
            llm.shutdown()
        assert sent[0].priority == 2
        assert sent[0].scheduling == SchedulingInfo(priority=2, tenant="t")
        assert sent[1].priority == 3 and sent[1].scheduling is None  # only a priority: as before
        assert len(sent) == 2

    asyncio.run(main())
