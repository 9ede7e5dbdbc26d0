"""DPEngineCoreProc: one engine of an expert-parallel data-parallel group, stepping in waves.

With ``executor.expert_parallel`` on a mixture-of-experts model, every MoE layer
is a collective over the data-parallel engines (parallel/expert.py), so an
engine cannot simply stop while another runs. Each engine schedules its own
requests; the group moves in *waves*:

- An engine joins a wave when a request reaches it while it is idle (it then
  tells the frontend ``start_wave``, which starts the wave on the others unless
  it already did) or when START_DP_WAVE (a ``DPWaveStart``) arrives for a wave
  it has not finished (a start for a finished wave is stale and ignored).
- While in a wave an engine runs one forward per loop iteration: its own step,
  or a dummy batch (one token into the null KV block) when it has nothing to
  run, so that every engine takes part in the same collectives.
- Every ``executor.dp_wave_check_steps`` steps the engines all-reduce how many
  of them have unfinished requests (a gloo group of their own, beside the
  experts'); none: the wave ends on all of them at that step, and engine 0
  sends the frontend ``wave_complete``. Once a check finds an engine idle, they
  check every step until the wave ends (an idle engine burns dummy forwards).

Dense models keep independent engines (EngineCoreProc). One engine's death
breaks the others' collectives: they fail within the collective timeout, at
once when the dead engine's sockets close, and the frontend fails the whole
group (engine/dp_client.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from baton.engine.core_proc import EngineCoreProc
from baton.errors import ConfigError
from baton.parallel.expert import ExpertGroup, connect_group
from baton.protocol import DPWaveStart, EngineCoreOutputs, EngineCoreRequest, RequestType

log = logging.getLogger(__name__)


class DPEngineCoreProc(EngineCoreProc):
    """EngineCoreProc's loop with waves, dummy batches and the periodic global check."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        core = self.core
        ex = core.config.executor
        if not callable(getattr(core.executor, "execute_dummy_batch", None)):
            raise ConfigError(
                f"executor {ex.backend!r} has no execute_dummy_batch(): it cannot run an "
                "expert-parallel engine (executor.expert_parallel); use executor.backend = 'uniproc'"
            )
        if core.batch_queue_size > 1:
            raise ConfigError(
                "executor.expert_parallel needs one batch in flight per engine (no pipeline "
                "batch queue): set pipeline_parallel_size to 1"
            )
        self.dp_rank, self.dp_size = ex.data_parallel_rank, ex.data_parallel_size
        self.check_steps = ex.dp_wave_check_steps
        self.group: ExpertGroup | None = None
        #: The wave this engine is in (running) or will join next (idle).
        self.wave = 0
        self.running = False
        self._steps = 0  # forwards in this wave: the same count on every engine
        self._next_check = self.check_steps
        #: Figures for tests and logs: waves ended here, dummy forwards run.
        self.waves_done = 0
        self.dummy_batches = 0

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        for t in self._threads:
            t.start()
        core = self.core
        try:
            self.group = connect_group(core.config.executor, "dp", torch.device("cpu"))
            self.output_queue.put(self._ready_frames())
            was_busy = False
            while True:
                if self.shutdown_requested.is_set() and self._shutdown_step():
                    return
                self._drain_input(block=not core.has_work() and not self.running)
                outputs, ran = core.step_fn()
                busy = core.has_work()
                if not ran and (busy or self.running):
                    core.executor.execute_dummy_batch()  # type: ignore[attr-defined]
                    self.dummy_batches += 1
                    ran = True
                if outputs is not None and (
                    outputs.outputs or outputs.utility_output or busy or was_busy
                ):
                    self.output_queue.put(outputs)
                was_busy = busy
                if ran:
                    self.running = self._wave_goes_on(busy)
                    if not self.running:
                        self._end_wave()
        except BaseException as e:
            self.fatal = e
            self._send_dead(e)
            raise
        finally:
            self._close()

    def _wave_goes_on(self, busy: bool) -> bool:
        """After each forward of a wave: False once no engine has unfinished requests (a
        collective on check steps, so every engine answers the same at the same step)."""
        self._steps += 1
        if self._steps < self._next_check:
            return True
        assert self.group is not None
        count = self.group.all_reduce(torch.tensor([int(busy)], dtype=torch.int64))
        busy_engines = int(count[0])
        if busy_engines == 0:
            return False
        # an idle engine burns a dummy forward a step: look again at the next one
        self._next_check = self._steps + (1 if busy_engines < self.dp_size else self.check_steps)
        return True

    def _end_wave(self) -> None:
        log.debug(
            "engine %d: wave %d ended after %d steps", self.engine_index, self.wave, self._steps
        )
        if self.dp_rank == 0:
            self.output_queue.put(
                EngineCoreOutputs(
                    engine_index=self.engine_index,
                    wave_complete=self.wave,
                    timestamp=time.monotonic(),
                )
            )
        self.wave += 1
        self.waves_done += 1
        self._steps = 0
        self._next_check = self.check_steps

    # ------------------------------------------------------------------ messages

    def _handle(self, rtype: RequestType, payload: Any) -> None:
        if rtype is RequestType.START_DP_WAVE:
            self._start_wave(payload)
        else:
            super()._handle(rtype, payload)

    def _start_wave(self, start: DPWaveStart) -> None:
        if start.exclude_engine == self.engine_index or start.wave < self.wave:
            return  # its own start, or a wave every engine has finished (stale)
        if not self.running:
            log.debug("engine %d: wave %d starts (idle here)", self.engine_index, start.wave)
        self.wave = start.wave
        self.running = True

    def _add(self, req: EngineCoreRequest) -> None:
        if not self.running:
            # join a wave now and tell the frontend, which starts it on the engines still idle
            # (a no-op when it already did: it sent this request for the wave it started)
            self.running = True
            self.output_queue.put(
                EngineCoreOutputs(
                    engine_index=self.engine_index,
                    start_wave=self.wave,
                    timestamp=time.monotonic(),
                )
            )
        super()._add(req)

    # ------------------------------------------------------------------ shutdown

    def _shutdown_step(self) -> bool:
        """Drain mode keeps stepping (dummy batches included) while the wave runs, so the other
        engines' collectives still meet this one's."""
        timeout = self.core.config.serving.shutdown_timeout
        deadline = self._shutdown_deadline
        if (
            self.running
            and timeout > 0
            and (deadline is None or time.monotonic() < deadline)
            and not self.core.has_work()
        ):
            if deadline is None:
                self._shutdown_deadline = time.monotonic() + timeout
            return False
        return super()._shutdown_step()
