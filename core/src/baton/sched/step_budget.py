"""The latency-aware prefill budget: how many prompt tokens a step may compute.

With ``scheduler.target_step_ms`` on, the scheduler asks ``PrefillBudget``
before each step how many prompt tokens (chunks of running prompts and the
first chunks of admitted requests, all together) fit so that the step takes
about that long with the decodes it carries. Decodes are never cut: only the
prompt chunks shrink, and never below ``min_tokens`` (one KV block), so
prompts still progress when decodes alone fill the target. A step with no
decode is not held to the target: nobody waits there for a next token, and
large chunks compute prompts fastest. From one step with decodes to the next
the budget at most doubles (``MAX_GROWTH``): while every step carries chunks
of one size the fit cannot tell the cost of a prompt token from the fixed cost
of a step, and a per-token cost fitted near zero must not let one huge chunk
stall the decodes (the next measured step corrects it).

The target is a number of milliseconds, or ``"auto"`` (the default): a
multiple (``AUTO_MULTIPLE``, 1.75) of the time of a step of decodes alone, for
the batch the decodes grow to (``demand_rows``: the requests running and
waiting, up to a batch's most requests), so a step carrying prompt chunks takes
less than two decode steps' time on any machine, model and load, and prompts
still get most of a decode step's time in every step (they are never starved).
While prompts wait to join, the decodes running are few, and a target held to
them would admit prompts so slowly that the batch never fills (the simulator:
0.91-0.94x the throughput of "off"). That decode-only time is measured, not
fitted: while every step carries a prompt chunk the fit cannot tell a step's
fixed cost from a prompt token's (it gave the fixed cost to the decode rows, 4x
too much, and extrapolated to a full batch the target reached 2-3x its right
value), so the first step with decodes computes no prompt token (a probe),
so does the next while no decode-only step is measured (a probe of at most four
requests with none waiting runs as several decode steps, which the engine does
not time: after a warm-up or a quiet spell the burst that follows had none),
then one every ``PROBE_EVERY`` steps while the decode rows move by
more than a quarter and every ``PROBE_STALE`` steps anyway; the lower quartile
of the latest ``DECODE_SAMPLES`` decode-only steps (the smallest while there
are fewer than five: a neighbour only ever stretches a step, and on a shared
2-core host one probe stretched 2x next to one other set the median's target
1.6x too high for eight steps, whose gaps were the run's ITL p99), carried to
other batch sizes by the fitted model's shape and the cost model's (the smaller
of the two), sets the target. Before a probe is measured the fitted model
predicts it (it moved a burst's targets 0.07-0.8 s from step to step after a
warm-up, before the next step probed again); before any step is measured
``"auto"`` sets no target; its model treats the built-in prior as a shape whose
scale the first measured step sets (a machine five times slower than the
prior's must not read as a five-second fixed cost per step). Tuned on the scheduler simulator
(workload.json, machines 20x faster to 5x slower than the prior, 15% step
noise, seeds 0-4): ITL p99 within 1.8-2.7x p50 at 0.935-1.0x the throughput
of "off". The real engine on two CPU threads (workload.json) gave 1.24-1.31x at 0.79-0.83x the
throughput on an AMD host, 1.2-1.9x at 0.84-0.95x on an Intel AMX one (docs/benchmarks.md,
issue 34: a prompt token costs more in a mixed step than in a 2048-token chunk); with faster
attention and packed linears, 1.35-2.9x at 1.07x (0.98-1.13 by round) on AMD Zen 4. A larger
multiple buys throughput with the ratio: 2.25 gave ~0.98x there but 2.9-4.1x, the prompts done
sooner so that most gaps are decode-only steps and the mixed ones the tail.

The step time comes from ``StepTimeModel`` (``baton.sched.step_time_model``), a linear
model of a step's shape fitted online to the steps the engine measures.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import TYPE_CHECKING

from baton.errors import ConfigError
from baton.request import RequestStatus
from baton.sched.cost_model import DEFAULT as DEFAULT_COST_MODEL
from baton.sched.step_time_model import StepShape, StepTimeModel

if TYPE_CHECKING:
    from baton.sched.scheduler import Scheduler

log = logging.getLogger(__name__)

#: Most the prompt budget grows from one step with decodes to the next.
MAX_GROWTH = 2
#: ``target_step_ms = "auto"``: the target is this multiple of a decode-only step's time.
AUTO_MULTIPLE = 1.75
#: ``"auto"`` sets no target until this many steps have been measured.
AUTO_MIN_STEPS = 1
#: ``"auto"``: a measured time is taken at most this many times the model's prediction and at
#: least its inverse (a step stretched by a neighbour or a page-fault storm moves the fit by a
#: bounded amount; a lasting change is still followed, within a few steps).
AUTO_CLIP = 3.0
#: ``"auto"``: every this many steps with decodes (while prompt chunks ride along) is a
#: decode-only step, a direct measure of what the target is a multiple of (0: never).
PROBE_EVERY = 8
#: ``"auto"``: the most steps with decodes between probes however steady the decode rows.
PROBE_STALE = 32
#: ``"auto"``: the decode-only steps whose lower quartile sets the target's scale.
DECODE_SAMPLES = 5


class PrefillBudget:
    """Prompt tokens per step so that a step takes about its target (see the module docstring).

    ``target_s`` a number: a fixed target. None (``target_step_ms = "auto"``): the target is
    ``multiple`` times the time the step-time model predicts for a step of the same decodes
    alone (their rows and attention pairs), so it follows the machine, the model and the load;
    it sets no target until ``AUTO_MIN_STEPS`` steps have been measured. A prompt token is
    costed with the attention pairs recent prompt tokens had (a long prompt's later chunks
    attend to more), so the chunks the target leaves room for fit in it.
    """

    def __init__(
        self,
        target_s: float | None,
        *,
        min_tokens: int,
        max_tokens: int,
        model: StepTimeModel | None = None,
        multiple: float | None = None,
    ) -> None:
        """``multiple``: the ``"auto"`` target's multiple of a decode-only step (None:
        ``AUTO_MULTIPLE``)."""
        multiple = AUTO_MULTIPLE if multiple is None else multiple
        if target_s is not None and not (math.isfinite(target_s) and target_s > 0):
            raise ConfigError(
                f"scheduler.target_step_ms: must be a positive number of milliseconds, "
                f'"auto" or "off", got {target_s * 1000!r}'
            )
        if not (math.isfinite(multiple) and multiple > 1):
            raise ConfigError(f"PrefillBudget: multiple must be a number > 1, got {multiple!r}")
        self.target_s = target_s
        self.multiple = multiple
        self.min_tokens = max(1, min_tokens)
        self.max_tokens = max(self.min_tokens, max_tokens)
        auto = target_s is None
        self.model = model or StepTimeModel(
            prefill_scale=max_tokens, rescale_prior=auto, clip=AUTO_CLIP if auto else None
        )
        #: The target of the latest step with decodes, in seconds (None: none set).
        self.last_target_s: float | None = None
        #: The budget given to the latest step with decodes (None before the first).
        self._last: int | None = None
        self._decode_steps = 0
        #: (step count with decodes, decode rows) of the latest probe.
        self._last_probe: tuple[int, int] | None = None
        #: Whether the step being scheduled is a probe, and the id of the latest probe scheduled
        #: with no prompt token.
        self._probing = False
        self._probe_step = -1
        #: (rows, attention pairs, seconds) of the latest decode-only steps measured.
        self._decode_samples: collections.deque[tuple[int, int, float]] = collections.deque(
            maxlen=DECODE_SAMPLES
        )
        #: Attention pairs of the latest step's decodes, and the recent pairs per prompt token
        #: (a prompt token attends to its context: longer prompts cost more per token).
        self._decode_pairs = 0
        self._pairs_per_prompt_token = 0.0
        #: step id -> its shape, until its time is observed (a few at most; old ones dropped).
        self._pending: dict[int, StepShape] = {}

    @property
    def auto(self) -> bool:
        return self.target_s is None

    def target(
        self, decode_rows: int, decode_pairs: int = 0, demand_rows: int | None = None
    ) -> float | None:
        """Seconds a step with ``decode_rows`` decodes attending to ``decode_pairs`` tokens in
        all should take. None: no target yet (``"auto"`` before a step is measured).
        ``demand_rows``: the decode batch the engine is headed to (every unfinished request
        that fits in a batch, at least ``decode_rows``); ``"auto"`` targets a multiple of that
        batch's decode-only step (its pairs scaled from the present decodes'), so while prompts
        wait to join the decodes their chunks are not held to the few decodes running yet."""
        if self.target_s is not None:
            return self.target_s
        if self.model.num_observed < AUTO_MIN_STEPS:
            return None
        rows = max(decode_rows, demand_rows or 0)
        pairs = decode_pairs * rows // decode_rows if decode_rows > 0 else decode_pairs
        return self.multiple * self.decode_only_s(rows, pairs)

    def _probe_due(self, rows: int) -> bool:
        """Whether this step with decodes should be a probe: the first, every step while no
        decode-only step is measured (a probe that ran as several decode steps is not timed,
        and a burst after it would otherwise leave the target to the fit for ``PROBE_EVERY``
        steps: a fit of steps that all carry prompt chunks moved it 0.07-0.8 s from step to
        step), then at most every ``PROBE_EVERY`` steps while the decode rows moved by a
        quarter since the last probe, and every ``PROBE_STALE`` steps anyway (the machine's
        speed may change)."""
        if not PROBE_EVERY:
            return False
        last = self._last_probe
        if last is None:
            return True
        # no decode-only step measured: probe again unless the latest step scheduled is a probe
        # whose time is still to come (a step the engine never times, e.g. one of several
        # decode steps, stays pending, so an older pending probe is not waited for)
        pending = self._pending
        if not self._decode_samples and not (pending and self._probe_step == max(pending)):
            return True
        age = self._decode_steps - last[0]
        if age >= PROBE_STALE:
            return True
        return age >= PROBE_EVERY and abs(rows - last[1]) * 4 > last[1]

    def decode_only_s(self, rows: int, pairs: int) -> float:
        """Predicted seconds of a step of ``rows`` decodes alone attending to ``pairs`` tokens.

        From the latest decode-only steps measured (``DECODE_SAMPLES``), each carried to
        ``rows`` and ``pairs`` by a shape: the fitted model's and the prior's, the lower
        quartile of the samples for each (a step is stretched by a neighbour, never
        shortened), and the smaller of the two (a shape that is wrong, e.g. a fit that gave a
        fixed cost to the decode rows, must not inflate the target). Without a measured
        decode-only step: the fitted model's prediction."""
        samples = self._decode_samples
        if not samples:
            return self.model.predict(0, rows, pairs)
        estimates = []
        for shape in (self.model.predict, DEFAULT_COST_MODEL.step_cost):
            at = shape(0, rows, pairs)
            ratios = [at / base for base in (shape(0, r, p) for r, p, _ in samples) if base > 0]
            if ratios:
                carried = sorted(t * k for (_, _, t), k in zip(samples, ratios, strict=False))
                estimates.append(carried[(len(carried) - 1) // 4])
        return min(estimates) if estimates else self.model.predict(0, rows, pairs)

    def _per_prompt_token(self) -> float:
        """Seconds per prompt token, with the attention pairs recent prompt tokens had."""
        return self.model.coefficients[1] + self.model.per_pair * self._pairs_per_prompt_token

    def prefill_tokens(
        self, decode_rows: int, decode_pairs: int = 0, demand_rows: int | None = None
    ) -> int:
        """Most prompt tokens a step with ``decode_rows`` decodes (attending to ``decode_pairs``
        tokens in all) should compute; a step with no decode is not held to the target (no
        request waits there for its next token). ``demand_rows``: see ``target``."""
        if decode_rows <= 0:
            return self.max_tokens
        self._decode_pairs = decode_pairs
        target = self.last_target_s = self.target(decode_rows, decode_pairs, demand_rows)
        if target is None:
            return self.max_tokens
        self._decode_steps += 1
        if self.auto and self._probe_due(decode_rows):
            self._last_probe = (self._decode_steps, decode_rows)
            self._probing = True
            return 0
        left = target - self.decode_only_s(decode_rows, decode_pairs)
        per_token = self._per_prompt_token()
        if per_token <= 0.0:
            n = self.max_tokens
        else:
            n = int(left / per_token) if left > 0 else 0
        if self._last is not None:
            n = min(n, MAX_GROWTH * self._last)
        n = min(self.max_tokens, max(self.min_tokens, n))
        self._last = n
        return n

    def scheduled(self, step_id: int, shape: StepShape) -> None:
        """Remember what step ``step_id`` computes, for ``observe``."""
        pending = self._pending
        pending[step_id] = shape
        if self._probing:  # a probe: its time is awaited if it computes decodes alone
            self._probing = False
            if shape.prefill_tokens == 0 and shape.decode_rows > 0:
                self._probe_step = step_id
        if shape.prefill_tokens > 0:
            per_token = max(0, shape.attention_pairs - self._decode_pairs) / shape.prefill_tokens
            old = self._pairs_per_prompt_token
            self._pairs_per_prompt_token = per_token if old == 0.0 else 0.5 * (old + per_token)
        self._decode_pairs = 0
        if len(pending) > 16:  # steps never observed (e.g. an output that ran nothing)
            del pending[min(pending)]

    def observe(self, step_id: int, seconds: float) -> bool:
        """Feed the measured wall time of step ``step_id``; whether it was used (a step it never
        scheduled, or a time that is not a finite number >= 0, is left out; the latter with a
        warning)."""
        shape = self._pending.pop(step_id, None)
        if shape is None:
            return False
        if not math.isfinite(seconds) or seconds < 0:
            log.warning(
                "step %d: measured step time %r s is not a finite number >= 0; the "
                "target_step_ms budget leaves it out",
                step_id,
                seconds,
            )
            return False
        self.model.observe(shape, seconds)
        if shape.prefill_tokens == 0 and shape.decode_rows > 0:
            self._decode_samples.append((shape.decode_rows, shape.attention_pairs, seconds))
        return True


def prefill_cap(sched: Scheduler) -> int:
    """Prompt tokens ``sched``'s next step may take under ``target_step_ms``: what the step-time
    model leaves beside the running decodes, whose tokens are set aside first."""
    assert sched.prefill_budget is not None
    in_flight = sched._in_flight
    per_batch = sched.max_num_seqs_per_batch
    decodes = pairs = others = 0
    for req in sched.running:
        if (
            req.status == RequestStatus.RUNNING
            and req.num_tokens - req.num_computed_tokens == 1
            and req.request_id not in in_flight
            and decodes < per_batch
        ):
            decodes += 1
            pairs += req.num_tokens  # its new token attends to every token
        else:
            others += 1
    room = sched.max_num_batched_tokens - decodes
    if not others and not len(sched.policy):
        # nothing but decodes: no prompt token to cap (and no probe to force: the step is a
        # decode-only one anyway), so the budget's bookkeeping is left out
        return room
    # the batch the decodes grow to once the prompts running and waiting are computed
    demand = min(per_batch, len(sched.running) + len(sched.policy))
    return max(0, min(sched.prefill_budget.prefill_tokens(decodes, pairs, demand), room))
