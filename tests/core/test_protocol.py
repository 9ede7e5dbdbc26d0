"""Protocol structs and the codec: round trips, tensors out of band, malformed frames rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.errors import InvalidRequestError, ProtocolError, StructuredOutputError
from baton.protocol import (
    CachedRequestData,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GrammarOutput,
    KVCacheSpec,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
    UtilityOutput,
    UtilityRequest,
)
from baton.sampling_params import SamplingParams, StructuredOutputSpec
from baton.serial import MsgpackDecoder, MsgpackEncoder

PARAMS = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    seed=3,
    max_tokens=20,
    stop=["\n\n"],
    logprobs=2,
    structured_outputs=StructuredOutputSpec(json={"type": "object"}),
    prompt_logprobs=1,
    logit_bias={5: -100.0, 7: 2.5},  # int keys survive msgpack
    allowed_token_ids=[5, 6, 7],
    bad_words=["no"],
    bad_words_token_ids=[[3], [4, 5]],
)

SAMPLES = [
    EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=PARAMS,
        eos_token_id=2,
        arrival_time=1.5,
        priority=-1,
        user="alice",
        cache_salt="s",
    ),
    UtilityRequest(call_id=7, method="get_stats", args=[1, "x"]),
    EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput(
                request_id="r1",
                new_token_ids=[5],
                finish_reason=FinishReason.LENGTH,
                stop_reason=9,
                new_logprobs=[
                    TokenLogprobs(token_ids=[5, 6], logprobs=[-0.1, -2.0], sampled_rank=1)
                ],
                events=[EngineCoreEvent(type=EngineCoreEventType.QUEUED, timestamp=2.0)],
                new_prompt_logprobs=[
                    TokenLogprobs(token_ids=[3, 1], logprobs=[-1.5, -0.5], sampled_rank=2)
                ],
            )
        ],
        scheduler_stats=SchedulerStats(step=3, num_running_reqs=1, kv_cache_usage=0.5),
        utility_output=UtilityOutput(call_id=7, result={"a": [1, 2]}),
    ),
    SchedulerOutput(
        step_id=4,
        scheduled_new_reqs=[
            NewRequestData(
                req_id="a",
                prompt_token_ids=[1, 2],
                sampling_params=PARAMS,
                block_ids=[0, 3],
                num_computed_tokens=0,
                output_token_ids=[7],
            )
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["b"], new_token_ids=[[4]], new_block_ids=[[]], num_computed_tokens=[9]
        ),
        num_scheduled_tokens={"a": 2, "b": 1},
        total_num_scheduled_tokens=3,
        finished_req_ids=["c"],
        preempted_req_ids=["d"],
        structured_output_req_ids=["a"],
    ),
    ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[[1], []],
        logprobs={"a": [TokenLogprobs(token_ids=[1], logprobs=[0.0], sampled_rank=1)]},
        prompt_logprobs={"a": [TokenLogprobs(token_ids=[2], logprobs=[-0.3], sampled_rank=1)]},
    ),
    KVCacheSpec(block_size=16, num_layers=30, num_kv_heads=3, head_size=64, dtype="float32"),
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_round_trip(obj):
    frames = MsgpackEncoder().encode(obj)
    assert MsgpackDecoder(type(obj)).decode([bytes(f) for f in frames]) == obj


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.float16])
def test_tensors_travel_out_of_band_and_bit_exact(dtype):
    big = (torch.randn(64, 1024) * 100).to(dtype)
    small = torch.arange(4, dtype=torch.int32)
    enc = MsgpackEncoder()
    frames = enc.encode(GrammarOutput(req_ids=["x"], bitmask=big))
    assert len(frames) == 2 and len(frames[0]) < 200  # body holds dtype/shape only
    got = MsgpackDecoder(GrammarOutput).decode(frames).bitmask
    assert got.dtype == dtype and torch.equal(got, big)
    frames = enc.encode(GrammarOutput(req_ids=["x"], bitmask=small))
    assert len(frames) == 1  # small arrays stay inline
    assert torch.equal(MsgpackDecoder(GrammarOutput).decode(frames).bitmask, small)


def test_numpy_arrays_and_zero_copy_decode():
    arr = np.arange(100_000, dtype=np.int64).reshape(1000, 100)
    frames = MsgpackEncoder().encode(GrammarOutput(req_ids=[], bitmask=arr))
    buf = bytearray(frames[1])
    got = MsgpackDecoder(GrammarOutput).decode([frames[0], buf]).bitmask
    assert np.array_equal(got, arr)
    buf[0] = 42  # the decoded array is a view of the received frame
    assert got.reshape(-1).view(np.uint8)[0] == 42


@pytest.mark.parametrize(
    "frames",
    [
        [b""],
        [b"\xc1garbage"],
        [b"\x93\x01\x02"],
        [],
        [MsgpackEncoder().encode(["r", "not a list"])[0]],
    ],
    ids=["empty-body", "garbage", "wrong-shape", "no-frames", "wrong-types"],
)
def test_malformed_frames_raise_protocol_error(frames):
    with pytest.raises(ProtocolError):
        MsgpackDecoder(EngineCoreRequest).decode(frames)


def test_missing_out_of_band_frame_is_a_protocol_error():
    frames = MsgpackEncoder().encode(GrammarOutput(req_ids=[], bitmask=torch.zeros(1000)))
    with pytest.raises(ProtocolError):
        MsgpackDecoder(GrammarOutput).decode(frames[:1])


def test_invalid_params_inside_a_frame_are_rejected():
    body = MsgpackEncoder().encode(
        EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams())
    )[0]
    bad = bytearray(body)
    # a hand-made frame with top_p = 5
    raw = MsgpackDecoder().decode([bytes(bad)])
    raw[2][2] = 5.0
    with pytest.raises(ProtocolError, match="top_p"):
        MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(raw))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field} .*got"):
        SamplingParams(**kwargs)


def test_sampling_params_conveniences():
    p = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert p.stop == ["END"] and p.top_k == 0 and p.greedy


def test_structured_output_spec_exactly_one():
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputSpec(regex="a+", choice=["x"])
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputSpec()
    with pytest.raises(StructuredOutputError, match="not valid JSON"):
        StructuredOutputSpec(json="{nope")
    assert (
        StructuredOutputSpec(json={"b": 1, "a": 2}).key()
        == StructuredOutputSpec(json='{"b":1,"a":2}').key()
    )
    # key order is kept: a schema's property order is the order of the output's properties
    assert (
        StructuredOutputSpec(json={"b": 1, "a": 2}).key()
        != StructuredOutputSpec(json={"a": 2, "b": 1}).key()
    )
