"""The ``pd`` connector's kv_transfer_params: what a producer returns, what a consumer accepts."""

from __future__ import annotations

import pytest

from baton.errors import InvalidRequestError
from baton.kv_transfer.pd.params import PDHandoff, parse_handoff, wants_load, wants_save

GOOD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "host-1-dp0",
    "num_tokens": 32,
    "namespace": "abc",
}


def test_the_producers_params_parse() -> None:
    assert parse_handoff(GOOD, "abc", 16) == PDHandoff(**GOOD)  # type: ignore[arg-type]
    assert wants_load(GOOD) and not wants_save(GOOD)
    assert wants_save({"do_remote_decode": True}) and not wants_load({"do_remote_decode": True})
    assert not wants_load(None) and not wants_save(None) and not wants_save({})
    assert not wants_save({"do_remote_decode": 1})  # JSON true only


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_tokens": 20}, "num_tokens = 20 is not a whole number of blocks of 16"),
        ({"num_tokens": -16}, "num_tokens = -16"),
        ({"namespace": "other"}, "namespace = 'other' is another model"),
        ({"num_tokens": "32"}, "is not a pd hand-off"),
        ({"surprise": 1}, "is not a pd hand-off"),
        ({"remote_engine_id": None}, "is not a pd hand-off"),
    ],
)
def test_bad_params_are_refused_by_name(change: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        parse_handoff({**GOOD, **change}, "abc", 16)
    assert info.value.param == "kv_transfer_params"


def test_missing_fields_are_refused() -> None:
    bad = dict(GOOD)
    del bad["num_tokens"]
    with pytest.raises(InvalidRequestError, match="num_tokens"):
        parse_handoff(bad, "abc", 16)
