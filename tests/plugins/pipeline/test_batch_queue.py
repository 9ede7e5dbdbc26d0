"""With PP=2 the engine core keeps two batches in flight, and the two stages really run them at once."""

from __future__ import annotations

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.protocol import EngineCoreRequest
from baton.sampling_params import SamplingParams
from baton.testing.tiny_model import tiny_model


def test_two_batches_in_flight_overlap_across_stages_and_never_share_a_request():
    cfg = BatonConfig.load(
        model=str(tiny_model("llama")),
        executor="pipeline",
        pipeline_parallel_size=2,
        device="cpu",
        num_threads=1,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_cache_memory="64MiB",
        max_model_len=512,
    )
    core = EngineCore(cfg)
    try:
        assert core.step_fn == core.step_with_batch_queue
        assert core.scheduler.max_num_seqs_per_batch == 4  # ceil(8 / 2): every batch gets its share
        in_flight: dict[int, set[str]] = {}
        shared: list[tuple[int, int, set[str]]] = []
        execute, update = core.executor.execute_model, core.scheduler.update_from_output

        def tracked_execute(so, non_block=False):
            ids = set(so.num_scheduled_tokens)
            shared.extend(
                (so.step_id, sid, ids & other) for sid, other in in_flight.items() if ids & other
            )
            in_flight[so.step_id] = ids
            return execute(so, non_block)

        def tracked_update(so, out):
            in_flight.pop(so.step_id, None)
            return update(so, out)

        core.executor.execute_model = tracked_execute
        core.scheduler.update_from_output = tracked_update
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for i in range(8):  # a workload larger than one batch
            prompt = [(31 * i + 7 * j) % 40000 + 3 for j in range(12 + 9 * i)]
            core.add_request(
                EngineCoreRequest(
                    request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params
                )
            )
        most_in_flight, tokens = 0, {}
        while core.has_work():
            outs, _ = core.step_fn()
            if outs is not None and outs.scheduler_stats is not None:
                most_in_flight = max(most_in_flight, outs.scheduler_stats.num_batches_in_flight)
            for o in outs.outputs if outs else ():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert most_in_flight == 2
        assert not shared, (
            f"a request was scheduled while in flight (step, other step, ids): {shared}"
        )
        assert sorted(len(t) for t in tokens.values()) == [24] * 8

        # the workers' own clocks: stage 0 ran a later batch while stage 1 still ran an earlier one
        stage0, stage1 = (s["timeline"] for s in core.executor.parallel_stats(timeline=True))
        overlaps = [
            (a, b) for a, s0, e0 in stage0 for b, s1, e1 in stage1 if a > b and s0 < e1 and s1 < e0
        ]
        assert overlaps, "the two stages never worked on different batches at the same time"
    finally:
        core.shutdown()
