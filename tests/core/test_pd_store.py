"""The ``pd`` connector's hand-off store (real files) and its kv_transfer_params checks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from baton.errors import InvalidRequestError
from baton.kv_transfer.pd.params import PDHandoff, parse_handoff, wants_load, wants_save
from baton.kv_transfer.pd.store import BadBlockError, HandoffStore

H = bytes(range(16))
PAYLOAD = os.urandom(4096)


def test_a_written_block_reads_back_whole(tmp_path: Path) -> None:
    store = HandoffStore(tmp_path, "ns", "tp0-pp0")
    assert store.read("t1", 0, H, len(PAYLOAD)) is None  # not written yet
    store.write("t1", 0, H, PAYLOAD)
    assert store.read("t1", 0, H, len(PAYLOAD)) == PAYLOAD
    assert store.read("t1", 0, bytes(16), len(PAYLOAD)) is None  # another prompt's block
    assert not [p for p in store.folder("t1").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "resize"])
def test_a_damaged_block_is_refused(tmp_path: Path, damage: str) -> None:
    store = HandoffStore(tmp_path, "ns", "tp0-pp0")
    store.write("t1", 0, H, PAYLOAD)
    path = store.block_path("t1", 0, H)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:-100])
    elif damage == "flip":
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(BadBlockError, match="t1"):
        # "resize": the file is whole but not the size this engine's blocks have
        store.read("t1", 0, H, len(PAYLOAD) + (8 if damage == "resize" else 0))


def test_remove_shard_keeps_other_shards_files(tmp_path: Path) -> None:
    tp0 = HandoffStore(tmp_path, "ns", "tp0-pp0")
    tp1 = HandoffStore(tmp_path, "ns", "tp1-pp0")
    tp0.write("t1", 0, H, PAYLOAD)
    tp1.write("t1", 0, H, PAYLOAD)
    tp0.remove_shard("t1")
    assert tp0.read("t1", 0, H, len(PAYLOAD)) is None
    assert tp1.read("t1", 0, H, len(PAYLOAD)) == PAYLOAD
    tp1.remove_shard("t1")
    assert not tp0.folder("t1").exists()  # the last shard out removes the folder


def test_sweep_removes_only_old_handoffs(tmp_path: Path) -> None:
    store = HandoffStore(tmp_path, "ns", "tp0-pp0")
    store.write("old", 0, H, PAYLOAD)
    store.write("new", 0, H, PAYLOAD)
    past = time.time() - 1000
    os.utime(store.folder("old"), (past, past))
    assert store.sweep(max_age=500) == 1
    assert not store.folder("old").exists()
    assert store.read("new", 0, H, len(PAYLOAD)) == PAYLOAD
    assert HandoffStore(tmp_path / "none", "ns", "tp0-pp0").sweep(1.0) == 0


GOOD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "host-1-dp0",
    "transfer_id": "host-1-dp0.7",
    "num_tokens": 32,
    "namespace": "abc",
}


def test_the_producers_params_parse() -> None:
    assert parse_handoff(GOOD, "abc", 16) == PDHandoff(**GOOD)  # type: ignore[arg-type]
    assert wants_load(GOOD) and not wants_save(GOOD)
    assert wants_save({"do_remote_decode": True}) and not wants_load({"do_remote_decode": True})
    assert not wants_load(None) and not wants_save({})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"transfer_id": "../../etc"}, "transfer_id = '../../etc' is not a plain name"),
        ({"remote_engine_id": ""}, "remote_engine_id = '' is not a plain name"),
        ({"num_tokens": 20}, "num_tokens = 20 is not a whole number of blocks of 16"),
        ({"num_tokens": -16}, "num_tokens = -16"),
        ({"namespace": "other"}, "namespace = 'other' is another model"),
        ({"num_tokens": "32"}, "is not a pd hand-off"),
        ({"surprise": 1}, "is not a pd hand-off"),
    ],
)
def test_bad_params_are_refused_by_name(change: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        parse_handoff({**GOOD, **change}, "abc", 16)
    assert info.value.param == "kv_transfer_params"


def test_missing_fields_are_refused() -> None:
    bad = dict(GOOD)
    del bad["transfer_id"]
    with pytest.raises(InvalidRequestError, match="transfer_id"):
        parse_handoff(bad, "abc", 16)
