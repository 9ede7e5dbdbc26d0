"""Config: sources and their order, validation errors naming the field path, override forms."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("BATON_"):
            monkeypatch.delenv(k)


def test_defaults_match_the_brief():
    c = BatonConfig.load()
    assert c.model.name == "smollm2-135m-instruct"
    assert (c.cache.block_size, c.cache.enable_prefix_caching) == (16, True)
    assert (c.scheduler.policy, c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (
        "fcfs",
        64,
        2048,
    )
    assert (c.executor.backend, c.executor.device, c.transport.name) == (
        "uniproc",
        "auto",
        "inproc",
    )
    assert (c.server.host, c.server.port) == ("127.0.0.1", 8000)


def test_sources_in_order_strongest_first(tmp_path, monkeypatch):
    toml = tmp_path / "baton.toml"
    toml.write_text(
        '[scheduler]\npolicy = "priority"\nmax_num_seqs = 8\nmax_num_batched_tokens = 512\n'
    )
    monkeypatch.setenv("BATON_SCHEDULER__MAX_NUM_SEQS", "4")
    monkeypatch.setenv("BATON_SCHEDULER__MAX_NUM_BATCHED_TOKENS", "256")
    c = BatonConfig.load(toml, max_num_batched_tokens=128)
    assert c.scheduler.policy == "priority"  # file over default
    assert c.scheduler.max_num_seqs == 4  # env over file
    assert c.scheduler.max_num_batched_tokens == 128  # explicit over env


def test_config_file_from_env(tmp_path, monkeypatch):
    toml = tmp_path / "b.toml"
    toml.write_text("[cache]\nblock_size = 32\n")
    monkeypatch.setenv("BATON_CONFIG", str(toml))
    assert BatonConfig.load().cache.block_size == 32


def test_yaml_file(tmp_path):
    y = tmp_path / "baton.yaml"
    y.write_text("transport:\n  name: shm\ncache:\n  kv_cache_memory: 1GiB\n")
    c = BatonConfig.load(y)
    assert c.transport.name == "shm" and c.cache.kv_cache_memory == 2**30


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"max_num_seqs": 0}, "scheduler.max_num_seqs: Input should be greater than 0 (got 0)"),
        ({"model.dtype": "float8"}, "model.dtype"),
        ({"device": "tpu"}, "executor.device"),
        ({"kv_cache_memory": "lots"}, "cache.kv_cache_memory"),
        ({"port": 70000}, "server.port"),
    ],
)
def test_invalid_values_name_the_field_path(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        BatonConfig.load(**overrides)
    assert fragment in str(err.value)


def test_vllm_flat_names_dtype_and_kv_cache_dtype():
    """LLM(dtype=...) is the model's dtype as in vLLM, though cache.dtype shares the field name."""
    c = BatonConfig.load(dtype="bfloat16", kv_cache_dtype="float16")
    assert (c.model.dtype, c.cache.dtype) == ("bfloat16", "float16")


def test_invalid_file_value_names_the_file(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[cache]\nblock_size = -3\n")
    with pytest.raises(ConfigError, match=r"in .*bad\.toml:\n  cache\.block_size"):
        BatonConfig.load(toml)


def test_broken_toml_is_a_config_error(tmp_path):
    toml = tmp_path / "broken.toml"
    toml.write_text("[cache\nblock_size = ")
    with pytest.raises(ConfigError, match="could not be parsed"):
        BatonConfig.load(toml)


def test_unknown_section_and_key():
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        BatonConfig.load(bogus=1)
    with pytest.raises(ConfigError, match="unknown section 'nope'"):
        BatonConfig.load(**{"nope.x": 1})


def test_override_forms():
    c = BatonConfig.load(
        model="/some/folder",
        transport="zmq",
        executor="cuda-tp",
        policy="priority",
        cache={"block_size": 8},
        **{"scheduler.max_num_seqs": 3},
    )
    assert c.model.name == "/some/folder"
    assert (c.transport.name, c.executor.backend, c.scheduler.policy) == (
        "zmq",
        "cuda-tp",
        "priority",
    )
    assert (c.cache.block_size, c.scheduler.max_num_seqs) == (8, 3)


def test_plugin_sub_tables_from_file_and_env(tmp_path, monkeypatch):
    toml = tmp_path / "baton.toml"
    toml.write_text('[transport]\nname = "zmq"\n[transport.zmq]\nprotocol = "tcp"\n')
    monkeypatch.setenv("BATON_TRANSPORT__ZMQ__HWM", "7")
    c = BatonConfig.load(toml)
    assert c.transport.model_extra["zmq"] == {"protocol": "tcp", "hwm": "7"}


def test_replace_validates():
    c = BatonConfig.load()
    assert c.replace(enable_chunked_prefill=False).scheduler.enable_chunked_prefill is False
    with pytest.raises(ConfigError, match="block_size"):
        c.replace(block_size=0)


def test_configuration_doc_is_current():
    root = Path(__file__).parents[2]
    render = runpy.run_path(str(root / "tools" / "config_docs.py"))["render"]
    assert (root / "docs" / "configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: python tools/config_docs.py > docs/configuration.md"
    )


@pytest.mark.parametrize("level", ["debug", "Info", "Warning", "error", "critical"])
def test_log_level_takes_the_standard_names_in_any_case(level):
    assert BatonConfig.load(observability={"log_level": level}).observability.log_level == (
        level.upper()
    )


@pytest.mark.parametrize("level", ["LOUD", "", 10, None])
def test_log_level_must_be_a_standard_name(level, monkeypatch):
    with pytest.raises(ConfigError, match=r"observability\.log_level.*DEBUG, INFO, WARNING"):
        BatonConfig.load(observability={"log_level": level})
    with pytest.raises(ConfigError, match=r"observability\.log_level"):
        BatonConfig.load().replace(observability={"log_level": level})
    if isinstance(level, str):  # from the environment too (the engine process must not die of it)
        monkeypatch.setenv("BATON_OBSERVABILITY__LOG_LEVEL", level)
        with pytest.raises(ConfigError, match=r"observability\.log_level"):
            BatonConfig.load()
