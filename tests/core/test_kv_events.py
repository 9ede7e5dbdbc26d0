"""KV cache events recorded by the pool and the manager (no model, no socket), and the
``[kv_events]`` section's refusals. The events over ZeroMQ from a running engine:
test_kv_events_zmq.py."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.kv.event_publisher import NullEventPublisher, make_kv_event_publisher, rank_endpoint
from baton.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from baton.kv.hashing import update_block_hashes
from baton.kv.manager import KVCacheManager
from baton.lora.request import LoRARequest
from baton.sched.policies import FCFSPolicy
from baton.sched.scheduler import Scheduler
from baton.testing.sched_harness import SchedulerDriver

from .sched_helpers import make_config, make_request

BS = 16


def _hashed(rid, prompt, **kw):
    r = make_request(rid, prompt, **kw)
    update_block_hashes(r, BS)
    return r


def _compute(mgr: KVCacheManager, r, n: int) -> None:
    """Allocate and 'compute' n tokens of r, registering full blocks as the scheduler does."""
    hits, num_hit = mgr.get_computed_blocks(r) if r.request_id not in mgr.req_to_blocks else ([], 0)
    assert mgr.allocate_slots(r, n, hits) is not None
    r.num_computed_tokens += num_hit + n
    mgr.cache_blocks(r, r.num_computed_tokens)


def test_off_records_nothing():
    mgr = KVCacheManager(6, BS)  # 5 usable: the second request evicts the first's blocks
    assert mgr.pool.kv_events is None
    a = _hashed("a", 64)
    _compute(mgr, a, 64)
    mgr.free(a)
    b = _hashed("b", 64)
    _compute(mgr, b, 64)
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    assert mgr.pool.kv_events is None and mgr.take_events() == []


def test_block_stored_per_registration_with_the_parent_chain_and_tokens():
    mgr = KVCacheManager(64, BS, enable_kv_cache_events=True)
    a = _hashed("a", 56)  # 3 full blocks, 8 tokens over
    _compute(mgr, a, 20)  # block 0 computed, block 1 part-way
    _compute(mgr, a, 36)  # blocks 1 and 2
    first, second = mgr.take_events()
    assert first == BlockStored(
        block_hashes=[a.block_hashes[0]],
        parent_block_hash=None,
        token_ids=a.prompt_token_ids[:16],
        block_size=BS,
        lora_id=None,
        medium="GPU",
    )
    assert second.block_hashes == a.block_hashes[1:3]
    assert second.parent_block_hash == a.block_hashes[0]
    assert second.token_ids == a.prompt_token_ids[16:48]
    assert mgr.take_events() == []  # taken


def test_a_prefix_hit_stores_only_the_new_blocks_after_it():
    mgr = KVCacheManager(64, BS, enable_kv_cache_events=True)
    shared = list(range(1, 33))
    a = _hashed("a", [*shared, 5])
    _compute(mgr, a, 33)
    mgr.take_events()
    b = _hashed("b", [*shared, *range(40, 57), 9])  # 2 blocks hit, 1 new full block
    _compute(mgr, b, len(b.all_token_ids) - 32)
    (stored,) = mgr.take_events()
    assert stored.block_hashes == [b.block_hashes[2]]
    assert stored.parent_block_hash == a.block_hashes[1] == b.block_hashes[1]
    assert stored.token_ids == list(range(40, 56))


def test_a_block_cached_meanwhile_by_another_request_splits_the_run():
    """Two requests compute the same prompt at once: the second's blocks enter nothing (the
    first's are cached) and are not announced again; a run after them names its parent."""
    mgr = KVCacheManager(64, BS, enable_kv_cache_events=True)
    prompt = list(range(1, 33))
    a = _hashed("a", [*prompt, 1])
    b = _hashed("b", [*prompt, *range(100, 117)])
    assert mgr.allocate_slots(a, 33) is not None
    assert mgr.allocate_slots(b, len(b.all_token_ids)) is not None  # no hit: a is not computed
    a.num_computed_tokens = 33
    mgr.cache_blocks(a, 33)
    b.num_computed_tokens = len(b.all_token_ids)
    mgr.cache_blocks(b, b.num_computed_tokens)
    from_a, from_b = mgr.take_events()
    assert from_a.block_hashes == a.block_hashes[:2]
    assert from_b.block_hashes == [b.block_hashes[2]]
    assert from_b.parent_block_hash == b.block_hashes[1]
    assert from_b.token_ids == list(range(100, 116))


def test_lora_id_is_the_requests_adapter():
    mgr = KVCacheManager(64, BS, enable_kv_cache_events=True)
    r = make_request("a", 17)
    r.lora_request = LoRARequest("sql", 7, "/x")
    update_block_hashes(r, BS)
    _compute(mgr, r, 17)
    (stored,) = mgr.take_events()
    assert stored.lora_id == 7


def test_evictions_are_block_removed_and_reset_is_all_blocks_cleared():
    mgr = KVCacheManager(6, BS, enable_kv_cache_events=True)  # 5 usable
    a = _hashed("a", 64)  # 4 blocks, all cached
    _compute(mgr, a, 64)
    mgr.free(a)
    b = _hashed("b", 48)  # 3 blocks: the free one, then 2 of a's, tail first
    _compute(mgr, b, 48)
    stored_a, removed, stored_b = mgr.take_events()
    assert isinstance(stored_a, BlockStored) and isinstance(stored_b, BlockStored)
    # a was freed tail first, so its last two blocks are evicted first; one event for both
    assert removed == BlockRemoved(block_hashes=a.block_hashes[:1:-1], medium="GPU")
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    assert mgr.take_events() == [AllBlocksCleared()]
    assert mgr.pool.evict(1) == 0 and mgr.take_events() == []  # nothing cached any more


def test_refused_reset_records_nothing():
    mgr = KVCacheManager(8, BS, enable_kv_cache_events=True)
    a = _hashed("a", 20)
    _compute(mgr, a, 20)
    mgr.take_events()
    assert not mgr.reset_prefix_cache()  # a holds blocks
    assert mgr.take_events() == []


def test_scheduler_take_kv_events_after_a_run():
    cfg = make_config()
    sched = Scheduler(
        cfg.scheduler, cfg.cache, FCFSPolicy(), 64, max_model_len=512, enable_kv_cache_events=True
    )
    prompt = list(range(1, 41))
    driver = SchedulerDriver(sched)
    driver.add(make_request("a", prompt, max_tokens=4, eos=None))
    driver.run()
    events = sched.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]
    assert stored[0].token_ids == prompt[:32]
    assert sched.take_kv_events() == []
    assert sched.reset_prefix_cache()
    assert sched.take_kv_events() == [AllBlocksCleared()]


def test_scheduler_without_events_takes_none():
    cfg = make_config()
    sched = Scheduler(cfg.scheduler, cfg.cache, FCFSPolicy(), 64, max_model_len=512)
    driver = SchedulerDriver(sched)
    driver.add(make_request("a", 40, max_tokens=4, eos=None))
    driver.run()
    assert sched.kv.pool.kv_events is None and sched.take_kv_events() == []


# ----------------------------------------------------------------------------- config


def test_defaults_are_off():
    ev = BatonConfig.load().kv_events
    assert not ev.enable_kv_cache_events
    assert ev.publisher == "zmq" and ev.endpoint == "tcp://127.0.0.1:5557"
    assert ev.replay_endpoint is None and ev.topic == ""
    assert make_kv_event_publisher(ev, 0) is None


@pytest.mark.parametrize(
    ("kv_events", "message"),
    [
        (
            {"endpoint": "tcp://0.0.0.0:5557"},
            r"kv_events\.endpoint: .*'tcp://0\.0\.0\.0:5557'.*127",
        ),
        ({"endpoint": "tcp://127.0.0.1:70000"}, r"kv_events\.endpoint: .*PORT 1-65535"),
        ({"endpoint": "tcp://*:5557"}, r"kv_events\.endpoint: .*tcp://127\.0\.0\.1:PORT"),
        ({"replay_endpoint": "localhost:1"}, r"kv_events\.replay_endpoint: .*ipc://"),
        ({"publisher": "kafka"}, r"kv_events\.publisher: Input should be 'zmq' or 'null'"),
        ({"buffer_steps": 0}, r"kv_events\.buffer_steps: Input should be greater than 0"),
        (
            {"replay_endpoint": "tcp://127.0.0.1:5557"},
            r"replay_endpoint = endpoint = 'tcp://127\.0\.0\.1:5557'",
        ),
    ],
)
def test_bad_values_are_refused_with_the_field(kv_events, message):
    with pytest.raises(ConfigError, match=message):
        BatonConfig.load(kv_events=kv_events)


def test_data_parallel_port_ranges_must_not_meet():
    ev = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5558",
    }
    with pytest.raises(ConfigError, match=r"5557\.\.5558 and 5558\.\.5559.*e\.g\. 5559"):
        BatonConfig.load(kv_events=ev, data_parallel_size=2)
    BatonConfig.load(
        kv_events={**ev, "replay_endpoint": "tcp://127.0.0.1:5559"}, data_parallel_size=2
    )
    BatonConfig.load(kv_events=ev)  # one engine: no overlap
    with pytest.raises(ConfigError, match=r"would bind port 65536"):
        BatonConfig.load(
            kv_events={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:65535"},
            data_parallel_size=2,
        )


def test_unknown_key_is_refused_at_start_up():
    from baton.plugins.check import check_config_plugins
    from baton.plugins.registry import get_registry

    with pytest.raises(ConfigError, match=r"kv_events\.endpiont: unknown setting"):
        check_config_plugins(BatonConfig.load(kv_events={"endpiont": "x"}), get_registry())


def test_rank_endpoints():
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert rank_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    assert rank_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"


def test_null_publisher_binds_nothing():
    ev = BatonConfig.load(kv_events={"enable_kv_cache_events": True, "publisher": "null"})
    publisher = make_kv_event_publisher(ev.kv_events, 0)
    assert isinstance(publisher, NullEventPublisher)
