"""``[kv_transfer.offload]``: sizes parsed as cache.kv_cache_memory is, unknown keys refused."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from baton.config import BatonConfig
from baton.kv_transfer.offload import OffloadSettings
from baton.kv_transfer.offload.layout import block_nbytes, shard_key, shard_keys
from baton.kv_transfer.types import KVNamespace
from baton.plugins.registry import get_registry


def test_sizes_and_defaults() -> None:
    s = OffloadSettings(cpu_memory="2GiB", disk_path="/tmp/kv", disk_memory="512MiB")
    assert s.cpu_memory == 2 << 30 and s.disk_memory == 512 << 20
    assert s.disk_path == Path("/tmp/kv") and s.disk_write_behind
    d = OffloadSettings()
    assert d.cpu_memory == 1 << 30 and d.disk_path is None


@pytest.mark.parametrize(
    "bad", [{"cpu_memory": "lots"}, {"disk_memory": 0}, {"cpu_memroy": "1GiB"}]
)
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        OffloadSettings(**bad)


def test_the_config_validates_the_sub_table() -> None:
    entry = get_registry().get("kv_connector", "offload")
    cfg = BatonConfig.load(kv_transfer={"connector": "offload", "offload": {"cpu_memory": "3MiB"}})
    settings = entry.settings(cfg)
    assert isinstance(settings, OffloadSettings) and settings.cpu_memory == 3 << 20


def test_block_bytes_and_shard_keys() -> None:
    ns = KVNamespace(
        model="m",
        kv_dtype="bfloat16",
        block_size=16,
        num_layers=30,
        num_kv_heads=3,
        head_size=64,
        tensor_parallel_size=2,
        key="abc",
    )
    assert block_nbytes(ns) == 2 * 30 * 3 * 64 * 16 * 2
    assert shard_keys(ns) == ["abc-tp0-pp0", "abc-tp1-pp0"]
    with pytest.raises(ValueError, match="no key"):
        shard_key(
            KVNamespace(**{**{f: getattr(ns, f) for f in ns.__struct_fields__}, "key": ""}), 0, 0
        )
