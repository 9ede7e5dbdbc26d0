"""Containment across process boundaries: a request that fails in an engine or worker process
fails alone, and the engine serves on.

The faults are injected by a test plugin (loaded in every process the kernel spawns): an
executor whose runner fails the preparation of a request seeded PREP_SEED and the sampling
of a request seeded SAMPLE_SEED, triggered through the request itself. It runs behind the
zmq transport (an engine process) and as a two-stage pipeline (worker processes, where only
the last stage samples). AsyncLLM, with the engine on a thread (inproc), covers the errors
of admission and of output processing.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import pytest

from baton import LLM, AsyncLLM, SamplingParams
from baton.engine.core import EngineCore
from baton.errors import BatonError
from baton.frontend.detokenizer import IncrementalDetokenizer
from baton.plugins.registry import reset_plugins

from .conftest import greedy_reference

PREP_SEED = 911_001
SAMPLE_SEED = 911_002
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
GOOD_PROMPTS = ["The weather today is", "1 2 3 4"]
GOOD_PARAMS = [GREEDY, SEEDED]

FAULTY_PLUGIN = """
from baton import hookimpl
from baton.executor.uniproc import UniprocExecutor
from baton.worker.input_batch import InputBatch
from baton.worker.model_runner import ModelRunner
from baton.worker.worker import runner_settings
from baton.worker.sampler import Sampler

PREP_SEED = 911_001
SAMPLE_SEED = 911_002


class FaultyInputBatch(InputBatch):
    def _set_sampling(self, row, sp, eos_token_ids):
        if sp.seed == PREP_SEED:
            raise OverflowError("injected preparation fault")
        super()._set_sampling(row, sp, eos_token_ids)


class FaultySampler(Sampler):
    def __call__(self, logits, md):
        if any(s is not None and s[0] == SAMPLE_SEED for s in md.seeds):
            raise RuntimeError("injected sampling fault")
        return super().__call__(logits, md)


def inject(runner):
    runner.input_batch.__class__ = FaultyInputBatch
    runner.sampler.__class__ = FaultySampler


class FaultyRunner(ModelRunner):
    def load_model(self):
        super().load_model()
        inject(self)


def faulty_runner(cfg, device):
    return FaultyRunner(runner_settings(cfg), device)


class FaultyUniproc(UniprocExecutor):
    def _init_worker(self):
        self.worker.runner_cls = faulty_runner
        super()._init_worker()


try:
    from baton_pipeline.executor import create_pipeline_executor
    from baton_pipeline.runner import PipelineStageHooks
except ImportError:
    create_pipeline_executor = None


def faulty_pipeline_runner(config, device):
    # the pipeline's runner factory, with the faults injected (pickled to the workers)
    return FaultyRunner(config, device, hooks=PipelineStageHooks())


@hookimpl
def register_executors(register):
    register("faulty", lambda config, settings=None: FaultyUniproc(config, settings))
    if create_pipeline_executor is not None:
        register(
            "faulty-pipeline",
            lambda config, settings=None: create_pipeline_executor(
                config, settings, runner=faulty_pipeline_runner
            ),
        )
"""


@pytest.fixture(scope="module")
def reference(model_dir):
    return greedy_reference(model_dir, GOOD_PROMPTS, GOOD_PARAMS)


@pytest.fixture
def faulty_plugin(tmp_path, monkeypatch):
    from tests.core.plugin_fixtures import make_dist

    site = make_dist(
        tmp_path / "site", "baton-test-faulty", "baton_test_faulty", textwrap.dedent(FAULTY_PLUGIN)
    )
    # spawned engine and worker processes find it through PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(site))
    reset_plugins()
    yield
    reset_plugins()
    sys.modules.pop("baton_test_faulty", None)


def check_faulty_requests_fail_alone(llm: LLM, reference: list[list[int]]) -> None:
    """One request failing in preparation and one in sampling, among good ones, twice."""
    prep = SamplingParams(temperature=1.0, seed=PREP_SEED, max_tokens=12, ignore_eos=True)
    samp = SamplingParams(temperature=1.0, seed=SAMPLE_SEED, max_tokens=12, ignore_eos=True)
    for _ in range(2):  # the engine serves on after the failures
        outs = llm.generate(
            [GOOD_PROMPTS[0], "Tell me a story", "Once upon a time", GOOD_PROMPTS[1]],
            [GOOD_PARAMS[0], prep, samp, GOOD_PARAMS[1]],
            use_tqdm=False,
        )
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "length"]
        assert outs[1].error == "OverflowError: injected preparation fault"
        assert outs[2].error == "RuntimeError: injected sampling fault"
        assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == reference


def test_faults_in_the_engine_process_fail_only_their_request(
    model_dir, reference, faulty_plugin, no_leaks
):
    with LLM(model=model_dir, max_model_len=256, transport="zmq", executor="faulty") as llm:
        check_faulty_requests_fail_alone(llm, reference)


def test_faults_in_pipeline_workers_fail_only_their_request(
    model_dir, reference, faulty_plugin, no_leaks
):
    pytest.importorskip("baton_pipeline")
    with LLM(
        model=model_dir,
        max_model_len=256,
        executor="faulty-pipeline",
        pipeline_parallel_size=2,
        device="cpu",
        num_threads=1,
    ) as llm:
        check_faulty_requests_fail_alone(llm, reference)


# ---------------------------------------------------------------- AsyncLLM, engine on a thread


async def _collect(llm: AsyncLLM, prompt: str, params: SamplingParams) -> list[int]:
    final = None
    async for out in llm.generate(prompt, params):
        final = out
    assert final is not None and final.finished
    return final.outputs[0].token_ids


async def _good_and_bad(llm: AsyncLLM, bad_params: SamplingParams) -> tuple[list, BaseException]:
    good = [
        asyncio.create_task(_collect(llm, p, sp))
        for p, sp in zip(GOOD_PROMPTS, GOOD_PARAMS, strict=True)
    ]
    with pytest.raises(BatonError) as err:
        await _collect(llm, "Tell me a story", bad_params)
    return [await t for t in good], err.value


def test_async_admission_and_output_faults_fail_only_their_request(
    model_dir, reference, monkeypatch
):
    add_request = EngineCore.add_request

    def faulty_add(self, request):
        if request.sampling_params.seed == PREP_SEED:
            raise TypeError("injected admission fault")
        add_request(self, request)

    update = IncrementalDetokenizer.update

    def faulty_update(self, new_token_ids):
        if "<<fail>>" in self._stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return update(self, new_token_ids)

    monkeypatch.setattr(EngineCore, "add_request", faulty_add)
    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty_update)

    async def main() -> None:
        llm = await AsyncLLM.create(model=model_dir, max_model_len=256)
        try:
            admission = SamplingParams(seed=PREP_SEED, max_tokens=12)
            good, err = await _good_and_bad(llm, admission)
            assert good == reference and str(err) == "TypeError: injected admission fault"
            output = SamplingParams(stop=["<<fail>>"], max_tokens=12, ignore_eos=True)
            good, err = await _good_and_bad(llm, output)
            assert good == reference and str(err).startswith("UnicodeDecodeError: ")
            assert not llm.errored
            stats = await llm.get_stats()
            assert (
                stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
            )  # aborted in the engine
        finally:
            llm.shutdown()

    asyncio.run(main())
