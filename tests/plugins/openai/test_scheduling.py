"""The body's ``priority`` (vLLM's) and ``scheduling: {...}`` (baton's extra) reach the scheduler
policy; bad values are OpenAI-shaped 400s whose ``param`` names the field."""

from __future__ import annotations

import pytest

from baton.scheduling_info import MAX_TAGS, SchedulingInfo
from tests.plugins.openai.test_validation import assert_400, assert_still_serving, chat, completion

SCHEDULING = {"deadline": 2.5, "tenant": "acme", "tags": {"team": "search"}}


@pytest.mark.parametrize("send", [chat, completion])
def test_priority_and_scheduling_reach_the_policy(server, policy_sees, send):
    r = send(server, priority=-2, scheduling=SCHEDULING)
    assert r.status_code == 200, r.text
    [req] = policy_sees
    assert req.scheduling == SchedulingInfo(priority=-2, **SCHEDULING)
    assert req.priority == -2 and req.deadline_time == pytest.approx(req.arrival_time + 2.5)


def test_the_openai_client_sends_it_as_extra_body(server, policy_sees):
    client = server.client()
    client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"priority": 4, "scheduling": {"tenant": "t1"}},
    )
    assert [(r.priority, r.scheduling.tenant) for r in policy_sees] == [(4, "t1")]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (dict(scheduling={"deadline": -1}), "scheduling.deadline", "scheduling.deadline"),
        (dict(scheduling={"deadline": "soon"}), "scheduling.deadline", "'soon'"),
        (dict(scheduling={"tenant": ""}), "scheduling.tenant", "1 to"),
        (dict(scheduling={"tags": {"k": 1}}), "scheduling.tags", "scheduling.tags['k']"),
        (
            dict(scheduling={"tags": {f"k{i}": "v" for i in range(MAX_TAGS + 1)}}),
            "scheduling.tags",
            f"{MAX_TAGS + 1} entries",
        ),
        (dict(scheduling={"deadline_s": 1}), "scheduling.deadline_s", "use priority, deadline"),
        (dict(scheduling={"priority": 2**63}), "scheduling.priority", "int64"),
        (dict(scheduling=[1]), "scheduling", "scheduling"),
        (dict(priority=1, scheduling={"priority": 2}), "priority", "disagree"),
    ],
)
@pytest.mark.parametrize("send", [chat, completion])
def test_bad_scheduling_is_a_400_naming_the_field(server, policy_sees, send, fields, param, words):
    err = assert_400(send(server, **fields), param)
    assert words in err["message"], err
    assert policy_sees == [], "a refused request never reaches the engine"
    assert_still_serving(server)
