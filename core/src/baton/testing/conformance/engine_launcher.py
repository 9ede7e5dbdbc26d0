"""Conformance suite for engine launchers: subclass ``EngineLauncherConformance``.

    from baton.testing.conformance import EngineLauncherConformance

    class TestMyLauncher(EngineLauncherConformance):
        name = "mine"               # looked up in the plugin registry
        settings = {"zone": "a"}    # the [executor.mine] sub-table (optional)

or override ``make_launcher(self, config)``. The checks, through ``LLM`` on a tiny
random-weight model with a transport that crosses processes (``transport``, zmq by
default): it implements ``baton.interfaces.EngineLauncher`` and ``close`` is
idempotent; the engine it launches serves exactly the greedy tokens of an engine in
this process; its handle (``baton.interfaces.EngineHandle``) is alive while it serves
and ``describe()`` says where it runs; ``LLM``'s shutdown stops it (terminate, join);
a handle killed while serving is a dead engine: the handle stops within
``stop_timeout`` and the next request raises ``EngineDeadError``.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest

from baton import LLM
from baton.config import BatonConfig
from baton.errors import EngineDeadError
from baton.interfaces import EngineHandle, EngineLauncher
from baton.plugins.registry import get_registry
from baton.sampling_params import SamplingParams
from baton.testing.tiny_model import tiny_model

#: The prompts (token ids) of the serving checks.
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), [7] * 12]


class EngineLauncherConformance:
    """Behaviour every engine launcher must show. Set ``name`` or override ``make_launcher``."""

    pytestmark = [pytest.mark.timeout(300)]

    #: The registered launcher name (``executor.data_parallel_backend``).
    name: ClassVar[str | None] = None
    #: Its ``[executor.<name>]`` settings for every test.
    settings: ClassVar[dict[str, Any]] = {}
    #: The transport between the frontend and the launched engines (it must cross processes).
    transport: ClassVar[str] = "zmq"
    #: Seconds a killed (or terminated) engine may take to stop.
    stop_timeout: ClassVar[float] = 30.0

    def overrides(self, **changes: Any) -> dict[str, Any]:
        """The suite's engine settings (``LLM(**overrides)``): a tiny model on the CPU, this
        launcher, ``transport``; ``changes`` on top."""
        if self.name is None:
            raise NotImplementedError("set name = '<registered launcher>' or override overrides")
        base: dict[str, Any] = {
            "model": str(tiny_model("llama")),
            "max_model_len": 128,
            "device": "cpu",
            "num_threads": 1,
            "kv_cache_memory": "16MiB",
            "transport": self.transport,
            "data_parallel_backend": self.name,
        }
        if self.settings:
            base[f"executor.{self.name}"] = dict(self.settings)
        return {**base, **changes}

    def make_launcher(self, config: BatonConfig) -> EngineLauncher:
        entry = get_registry().get("engine_launcher", config.executor.data_parallel_backend)
        launcher: EngineLauncher = entry.create(config, entry.settings(config))
        return launcher

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def greedy(llm: Any) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    @staticmethod
    def handles(llm: Any) -> list[EngineHandle]:
        """The handles of the engines ``llm``'s client launched."""
        return list(llm.engine.resources.procs)

    def wait_stopped(self, handle: EngineHandle) -> None:
        deadline = time.monotonic() + self.stop_timeout
        while handle.is_alive() and time.monotonic() < deadline:
            handle.join(0.1)
        assert not handle.is_alive(), f"{handle.describe()} still runs {self.stop_timeout} s on"

    # ------------------------------------------------------------------ tests

    def test_is_an_engine_launcher_and_close_is_idempotent(self) -> None:
        launcher = self.make_launcher(BatonConfig.load(**self.overrides()))
        assert isinstance(launcher, EngineLauncher)
        launcher.close()
        launcher.close()

    def test_its_engine_serves_like_one_in_this_process(self) -> None:
        with LLM(**self.overrides(transport="inproc", data_parallel_backend="mp")) as llm:
            expected = self.greedy(llm)
        with LLM(**self.overrides()) as llm:
            (handle,) = self.handles(llm)
            assert isinstance(handle, EngineHandle) and handle.is_alive()
            where = handle.describe()
            assert isinstance(where, str) and where, "describe() must say where the engine runs"
            assert self.greedy(llm) == expected
        self.wait_stopped(handle)  # the shutdown terminated and joined it
        assert isinstance(handle.describe(), str)

    def test_a_killed_engine_is_a_dead_engine(self) -> None:
        with LLM(**self.overrides()) as llm:
            (handle,) = self.handles(llm)
            assert len(self.greedy(llm)) == len(PROMPTS)
            handle.kill()
            self.wait_stopped(handle)
            with pytest.raises(EngineDeadError):
                deadline = time.monotonic() + self.stop_timeout
                while time.monotonic() < deadline:  # the client notices within its poll
                    self.greedy(llm)
                    time.sleep(0.2)
        handle.kill()  # idempotent
