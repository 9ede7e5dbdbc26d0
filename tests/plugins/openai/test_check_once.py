"""An HTTP request is checked once in the frontend: the plugin runs baton's check (to answer a 400
naming its own param) and hands AsyncLLM.generate the CheckedRequest, which is not checked again.
The engine core (here on a thread of this process) still checks each request it receives."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from baton import validation
from tests.plugins.openai.test_validation import assert_400, chat, completion


@pytest.fixture
def frontend_checks(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many times check_request ran (wherever it was imported) outside the engine core's
    own check_engine_request."""
    counts = {"check_request": 0, "check_engine_request": 0}
    for name in counts:
        real = getattr(validation, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _real(*args, **kwargs)

        for module in list(sys.modules.values()):
            if getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, counted)
    return lambda: counts["check_request"] - counts["check_engine_request"]


@pytest.mark.parametrize(("send", "n"), [(chat, 1), (chat, 2), (completion, 1), (completion, 2)])
def test_one_check_per_http_request(server, frontend_checks, send, n):
    r = send(server, n=n, temperature=0.5)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == n
    assert frontend_checks() == 1  # the plugin's; AsyncLLM.generate did not check again


def test_a_refused_request_is_still_a_400_naming_the_param(server, frontend_checks):
    assert_400(chat(server, max_tokens=10**6), "max_tokens")  # refused by check_request
    assert_400(completion(server, max_tokens=10**6), "max_tokens")
    assert frontend_checks() == 2


async def test_a_checked_request_for_another_model_is_checked_again():
    """AsyncLLM.generate re-checks a CheckedRequest made against other limits, and refuses
    parameters given beside one."""
    import msgspec

    from baton import AsyncLLM, SamplingParams
    from baton.errors import ContextLengthError, InvalidRequestError
    from baton.testing.tiny_model import tiny_model

    engine = await AsyncLLM.create(model=str(tiny_model("llama")), max_model_len=64)
    try:
        roomy = msgspec.structs.replace(engine.info, max_model_len=4096)
        params = SamplingParams(max_tokens=8)
        checked = validation.checked_request(list(range(3, 103)), params, roomy)
        with pytest.raises(ContextLengthError):
            async for _ in engine.generate(checked):
                pass
        ok = validation.checked_request([3, 4, 5], params, engine.info, user="u")
        with pytest.raises(InvalidRequestError, match="carries its own"):
            async for _ in engine.generate(ok, params):
                pass
        outs = [o async for o in engine.generate(ok, request_id="ok")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    finally:
        engine.shutdown()
