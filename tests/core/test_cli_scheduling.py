"""baton generate / baton chat: --priority, --deadline, --tenant, --tag reach the scheduler policy."""

from __future__ import annotations

import pytest

from baton.cli.main import main
from baton.scheduling_info import SchedulingInfo
from baton.testing.tiny_model import tiny_model

FLAGS = ["--priority", "3", "--deadline", "5", "--tenant", "acme"]
FLAGS += ["--tag", "team=search", "--tag", "flag="]


def test_generate_flags_reach_the_policy(policy_sees, capsys):
    model = str(tiny_model("llama"))
    argv = ["generate", "--model", model, "--max-model-len", "128", "--max-tokens", "2"]
    assert main([*argv, *FLAGS, "hi"]) == 0
    [req] = policy_sees
    assert req.scheduling == SchedulingInfo(
        priority=3, deadline=5.0, tenant="acme", tags={"team": "search", "flag": ""}
    )
    assert req.priority == 3 and req.deadline_time == pytest.approx(req.arrival_time + 5.0)


def test_chat_flags_reach_the_policy(policy_sees, capsys):
    model = str(tiny_model("llama"))
    argv = ["chat", "--model", model, "--max-model-len", "128", "--max-tokens", "2"]
    assert main([*argv, "--tenant", "acme", "--message", "hi"]) == 0
    assert [r.scheduling.tenant for r in policy_sees] == ["acme"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tag", "novalue"], "--tag 'novalue': use KEY=VALUE"),
        (["--deadline", "-1"], "scheduling.deadline must be in (0, "),
        (["--deadline", "nan"], "scheduling.deadline"),
        (["--slo-ttft-ms", "0"], "scheduling.slo_ttft_ms must be in (0, "),
        (["--slo-tpot-ms", "inf"], "scheduling.slo_tpot_ms must be in (0, "),
        (["--tenant", ""], "scheduling.tenant must have 1 to"),
        ([f"--tag=k{i}=v" for i in range(17)], "scheduling.tags has 17 entries"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_flags_are_refused_before_a_model_loads(command, flags, words, capsys, tmp_path):
    # the model does not exist: refusing the flags first is what keeps this error off
    argv = [command, "--model", str(tmp_path / "missing"), *flags]
    argv += ["hi"] if command == "generate" else ["--message", "hi"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and words in err, err
    assert "missing" not in err


def test_slo_flags_reach_the_policy(policy_sees, capsys):
    model = str(tiny_model("llama"))
    argv = ["generate", "--model", model, "--max-model-len", "128", "--max-tokens", "2"]
    assert main([*argv, "--slo-ttft-ms", "2000", "--slo-tpot-ms", "80", "hi"]) == 0
    [req] = policy_sees
    assert (req.scheduling.slo_ttft_ms, req.scheduling.slo_tpot_ms) == (2000.0, 80.0)
