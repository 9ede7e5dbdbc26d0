"""Property-based fuzzing of the request boundary: whatever a caller sends, the engine survives.

Hypothesis draws sampling parameters and prompts (huge, negative and non-finite
numbers, token ids outside the vocabulary, bytes, lone surrogates) and feeds them
to a real engine on a tiny random model, through the Python API and as raw
msgpack frames decoded at the engine's input boundary. Each example either is
refused with ``InvalidRequestError``/``ProtocolError`` or runs to a normal finish;
afterwards a reference request must still produce its reference tokens.
The examples are derandomised so that CI runs the same cases every time.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from baton import LLM, SamplingParams
from baton.errors import InvalidRequestError, ProtocolError
from baton.protocol import EngineCoreRequest, FinishReason
from baton.serial import MsgpackDecoder
from baton.testing.tiny_model import VOCAB_SIZE, tiny_model

MAX_MODEL_LEN = 48
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
REFERENCE = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

VOCAB = VOCAB_SIZE
# numbers at and around every boundary a field may have: int32/int64/uint64 edges, the vocabulary
EDGE_INTS = [-1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**20]
EDGE_INTS += [-(2**31), -(2**63), -(2**63) - 1, -(10**20), VOCAB - 1, VOCAB, VOCAB + 1]
ints = st.sampled_from(EDGE_INTS) | st.integers()
EDGE_FLOATS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e308, -1e308, 5e-324, 2.0000001]
floats = st.sampled_from(EDGE_FLOATS) | st.floats(allow_nan=True, allow_infinity=True)
# any code point, lone surrogates included (they cannot be encoded as UTF-8)
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
token_ids = st.lists(ints, min_size=1, max_size=4)

# what a well-behaved caller sends, field by field
VALID_FIELDS: dict[str, st.SearchStrategy] = {
    "n": st.integers(1, 3),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 0.5),
    "seed": st.none() | st.integers(0, 2**32),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 2),
    "stop": st.none() | st.lists(st.text("abc ", min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(0, 5),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
# and what an attacker puts in one or two of them
HOSTILE_FIELDS: dict[str, st.SearchStrategy] = {
    "n": ints,
    "temperature": floats,
    "top_p": floats,
    "top_k": ints,
    "min_p": floats,
    "seed": ints,
    "max_tokens": ints,
    "min_tokens": ints,
    "stop": texts | st.lists(texts, max_size=3),
    "stop_token_ids": token_ids,
    "logprobs": ints,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
}


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> dict:
    """Mostly valid parameters with up to two hostile fields (all-hostile ones rarely pass __init__)."""
    kwargs = draw(st.fixed_dictionaries({}, optional=VALID_FIELDS))
    for name in draw(st.lists(st.sampled_from(sorted(HOSTILE_FIELDS)), max_size=2, unique=True)):
        kwargs[name] = draw(HOSTILE_FIELDS[name])
    return kwargs


valid_prompts = st.one_of(
    st.text("abcdefgh ", min_size=1, max_size=20),
    st.lists(st.integers(0, 1000), min_size=1, max_size=8),
)
hostile_prompts = st.one_of(
    texts,
    token_ids,
    st.binary(max_size=6),
    st.fixed_dictionaries({"prompt_token_ids": token_ids}),
    st.fixed_dictionaries({"prompt": texts}),
    st.just([]),
)
prompts = st.one_of(valid_prompts, valid_prompts, hostile_prompts)


@pytest.fixture(scope="module")
def llm():
    with LLM(
        model=str(tiny_model("llama")), max_model_len=MAX_MODEL_LEN, max_num_seqs=16
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return _reference_tokens(llm)


def _reference_tokens(llm: LLM) -> list[int]:
    out = llm.generate("The engine is still", REFERENCE, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    return out.token_ids


def _bounded(params: SamplingParams) -> bool:
    """Whether a valid request is small enough to run here (the tiny model still costs steps)."""
    return params.n <= 4 and (params.max_tokens or MAX_MODEL_LEN) <= MAX_MODEL_LEN


@FUZZ
@given(kwargs=sampling_kwargs(), prompt=prompts)
# the cases that took the engine down before (issue 15), always run
@example(kwargs={"temperature": 1.0, "top_k": 10**20}, prompt="hi")
@example(kwargs={"min_tokens": 2, "stop_token_ids": [10**6]}, prompt="hi")
@example(kwargs={"stop_token_ids": [2**64]}, prompt="hi")
@example(kwargs={"temperature": float("inf")}, prompt="hi")
@example(kwargs={"top_k": VOCAB + 1, "temperature": 1.0}, prompt="hi")
@example(kwargs={}, prompt=b"abc")
@example(kwargs={}, prompt="\udc80x")
@example(kwargs={}, prompt=[])
def test_any_sampling_params_and_prompt_leave_the_engine_serving(llm, reference, kwargs, prompt):
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequestError:
        params = None  # refused where it was built: fine
    if params is not None and _bounded(params):
        try:
            outs = llm.generate(prompt, params, use_tqdm=False)
        except InvalidRequestError:
            pass  # refused at the frontend with a message: fine
        else:
            for out in outs:
                for c in out.outputs:
                    # a request that passed validation finishes normally, never with an error
                    assert c.finish_reason in ("stop", "length"), (kwargs, prompt, c)
    assert _reference_tokens(llm) == reference


# EngineCoreRequest and SamplingParams are msgpack arrays: field order is the wire order
_SP_ORDER = list(SamplingParams.__struct_fields__)
_ids = itertools.count()


@st.composite
def wire_requests(draw: st.DrawFn) -> list:
    """An EngineCoreRequest as a client could put it on the wire, fields fuzzed."""
    sp = draw(sampling_kwargs())
    sp_array = [sp.get(f, getattr(REFERENCE_DEFAULTS, f)) for f in _SP_ORDER]
    return [
        f"wire-{next(_ids)}",
        draw(st.lists(st.integers(0, 1000), min_size=1, max_size=8) | token_ids),
        sp_array,
        draw(st.none() | st.integers(0, 100) | ints),  # eos_token_id
        draw(st.floats(0, 1e6) | floats),  # arrival_time
        draw(st.integers(-5, 5) | ints),  # priority
        draw(st.none() | texts),  # user
        draw(st.none() | texts),  # cache_salt
        draw(st.integers(0, 3) | ints),  # client_index
    ]


REFERENCE_DEFAULTS = SamplingParams()


@FUZZ
@given(wire=wire_requests())
def test_any_request_frame_decoded_by_the_engine_leaves_it_serving(llm, reference, wire):
    try:
        frame = msgspec.msgpack.encode(wire)
    except (OverflowError, UnicodeEncodeError):
        return  # not expressible in msgpack: no client can send it
    try:
        request = MsgpackDecoder(EngineCoreRequest).decode([frame])
    except ProtocolError:
        return  # the engine's input thread drops it with a warning
    params = request.sampling_params
    if _bounded(params):
        core = llm.engine.core  # the inproc client's EngineCore: the engine's own boundary
        try:
            core.add_request(request)
        except InvalidRequestError:
            pass
        else:
            finished = _run_to_completion(core, request.request_id)
            assert finished.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (
                wire,
                finished,
            )
    assert _reference_tokens(llm) == reference


def _run_to_completion(core, request_id: str):
    for _ in range(4 * MAX_MODEL_LEN):
        outputs, _ = core.step_fn()
        for out in outputs.outputs if outputs is not None else ():
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError(f"request {request_id} did not finish")
