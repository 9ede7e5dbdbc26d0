"""The step-time model behind ``scheduler.target_step_ms``: seconds a step takes, from its shape.

A linear model

    seconds = overhead + per_prefill_token * prefill tokens + per_decode_row * decode rows
              + per_pair * attention pairs (each new token times the tokens it attends to)

fitted online by exponentially weighted least squares on the wall time of each
executed step (``EngineCore`` measures it and the scheduler passes it on). It
starts from the scheduler simulator's cost model
(``baton.sched.cost_model.DEFAULT``) as a few pseudo-steps, which decide alone
until steps are measured and then fade like any old step; a much weaker copy
that never fades keeps the fit defined when all recent steps have one shape
(e.g. decodes only: the cost of a prompt token is then what the latest steps
with prompt chunks said).

The budget that asks it is ``baton.sched.step_budget``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from baton.errors import ConfigError
from baton.sched.cost_model import DEFAULT as DEFAULT_COST_MODEL
from baton.sched.cost_model import CostModel

if TYPE_CHECKING:
    from collections.abc import Sequence


#: Weight of each step's sample after the next step (memory of ~10 steps): a change of
#: machine speed (a neighbour starts, the first steps' page faults end) is followed quickly.
FORGET = 0.9
#: Weight of the cost model's prior, in steps at full size (a whole budget of prompt tokens, the
#: most decode rows): small, so that one or two measured steps overrule it.
PRIOR_WEIGHT = 0.05
#: The share of the prior that never fades (keeps the normal equations solvable).
PRIOR_FLOOR = 1e-6
#: Shortest step time used to weigh a sample (relative error; guards a zero time).
MIN_STEP_S = 1e-3
#: Observed steps after which ``StepTimeModel.observe`` refits before clipping a time (else the
#: fit waits until a coefficient is read).
REFIT_EVERY = 16


class StepShape(msgspec.Struct, frozen=True):
    """What a scheduled step computes: prompt tokens, decode rows and attention pairs (each new
    token times the tokens it attends to, as ``baton.sched.cost_model.step_features``)."""

    prefill_tokens: int
    decode_rows: int
    attention_pairs: int = 0


#: Features of the step-time model: (1, prompt tokens, decode rows, attention pairs).
_N = 4


class StepTimeModel:
    """Seconds per step, linear in (1, prefill tokens, decode rows, attention pairs), fitted
    online. ``coefficients`` are the first three, ``per_pair`` the last."""

    def __init__(
        self,
        prior: CostModel = DEFAULT_COST_MODEL,
        *,
        prefill_scale: int = 2048,
        decode_scale: int = 64,
        pairs_scale: int = 2048 * 512,
        forget: float = FORGET,
        prior_weight: float = PRIOR_WEIGHT,
        rescale_prior: bool = False,
        clip: float | None = None,
    ) -> None:
        """``prefill_scale`` / ``decode_scale`` / ``pairs_scale``: typical feature sizes (the
        step's token budget, its most requests, their attention pairs), at which the prior
        counts as ``prior_weight`` observed steps. ``rescale_prior``: multiply the prior by
        the first measured step's time over its prediction, so that on a machine (or model)
        several times slower or faster than the prior's the first fits keep the prior's
        proportions instead of giving the whole difference to the least pinned coefficient.
        ``clip``: after the first step, a measured time counts as at most ``clip`` times the
        prediction and at least ``1 / clip`` times it (None: as measured)."""
        if not 0.0 < forget <= 1.0:
            raise ConfigError(f"StepTimeModel: forget must be in (0, 1], got {forget!r}")
        self.forget = forget
        self._prior = (
            prior.step_overhead_s,
            prior.prefill_s_per_token,
            prior.decode_s_per_token,
            prior.attention_s_per_token_pair,
        )
        scales = (
            1.0,
            float(max(1, prefill_scale)),
            float(max(1, decode_scale)),
            float(max(1, pairs_scale)),
        )
        # the prior's pseudo-steps weigh as steps of the prior's full-size step time would
        self._scale2 = prior.step_cost(int(scales[1]), int(scales[2]), 0) ** 2
        ridge = self._ridge = [prior_weight * s * s for s in scales]
        # exponentially weighted sums of x x^T and x t: the prior's pseudo-steps, then measured ones
        self._xx = [[ridge[i] if i == j else 0.0 for j in range(_N)] for i in range(_N)]
        self._xt = [r * p for r, p in zip(ridge, self._prior, strict=True)]
        #: The prior is a shape: the first measured step sets its scale (``rescale_prior``).
        self.rescale_prior = rescale_prior
        self.clip = clip
        self._floor = [PRIOR_FLOOR * r for r in ridge]
        self.num_observed = 0
        self._coef: tuple[float, ...] = self._prior
        #: observed steps not fitted yet: the fit runs when a coefficient is read (a batch-1
        #: decode reads none, and a fit per step was ~5% of its time on a 2-core Xeon)
        self._unfitted = 0

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """Seconds per step, per prompt token and per decode row, fitted to what was observed."""
        coef = self._fitted()
        return (coef[0], coef[1], coef[2])

    @coefficients.setter
    def coefficients(self, value: tuple[float, float, float]) -> None:
        self._coef = (*value, self._fitted()[3])

    @property
    def per_pair(self) -> float:
        """Seconds per attention pair (a token attending to one context token)."""
        return self._fitted()[3]

    def _fitted(self) -> tuple[float, ...]:
        if self._unfitted:
            self._coef = tuple(self._fit())
            self._unfitted = 0
        return self._coef

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Add one measured step (the coefficients are refitted when next read)."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"a step time must be a finite number of seconds >= 0, got {seconds!r}"
            )
        x = (
            1.0,
            float(shape.prefill_tokens),
            float(shape.decode_rows),
            float(shape.attention_pairs),
        )
        # relative error: a long step (large prompt chunks, a busy neighbour) does not outweigh
        # the shorter ones near the target, and the prior's scale stays that of a step
        if self.rescale_prior and self.num_observed == 0:
            self._scale_prior(seconds, x)
        elif self.clip is not None:
            # against a fit at most REFIT_EVERY steps old: clipping needs only the scale, and a
            # fit per step cost a batch-1 decode ~0.4 ms (py-spy, Xeon)
            coef = self._fitted() if self._unfitted >= REFIT_EVERY else self._coef
            predicted = _dot(coef, x)
            if predicted > 0.0:
                seconds = min(max(seconds, predicted / self.clip), predicted * self.clip)
        w = self._scale2 / max(seconds, MIN_STEP_S) ** 2
        lam = self.forget
        xx, xt = self._xx, self._xt
        for i in range(_N):
            xt[i] = lam * xt[i] + w * x[i] * seconds
            row = xx[i]
            for j in range(_N):
                row[j] = lam * row[j] + w * x[i] * x[j]
        self.num_observed += 1
        self._unfitted += 1

    def _scale_prior(self, seconds: float, x: tuple[float, ...]) -> None:
        predicted = _dot(self._prior, x)
        if predicted <= 0.0 or seconds <= 0.0:
            return
        factor = seconds / predicted
        self._prior = tuple(p * factor for p in self._prior)
        self._xt = [r * p for r, p in zip(self._ridge, self._prior, strict=True)]
        self._scale2 *= factor * factor

    def predict(self, prefill_tokens: int, decode_rows: int, attention_pairs: int = 0) -> float:
        x = (1.0, float(prefill_tokens), float(decode_rows), float(attention_pairs))
        return _dot(self._fitted(), x)

    def _fit(self) -> list[float]:
        """Least squares (with the faded prior); a negative coefficient is held at 0 and the
        others refitted (a step cannot get faster with more work)."""
        free = [True] * _N
        while True:
            coef = self._solve(free)
            negative = [i for i in range(_N) if free[i] and coef[i] < 0.0]
            if not negative:
                return coef
            for i in negative:
                free[i] = False

    def _solve(self, free: list[bool]) -> list[float]:
        idx = [i for i in range(_N) if free[i]]
        coef = [0.0] * _N
        if not idx:
            return coef
        ridge, prior = self._floor, self._prior
        a = [[self._xx[i][j] + (ridge[i] if i == j else 0.0) for j in idx] for i in idx]
        rhs = [self._xt[i] + ridge[i] * prior[i] for i in idx]
        for k, v in zip(idx, _solve_spd(a, rhs), strict=True):
            coef[k] = v
        return coef


def _dot(coef: Sequence[float], x: Sequence[float]) -> float:
    """Seconds of a step with features ``x`` (1, prompt tokens, decode rows, attention pairs)."""
    return sum(c * f for c, f in zip(coef, x, strict=True))


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a small symmetric positive definite system by Gaussian elimination."""
    n = len(b)
    a = [row[:] for row in a]
    b = b[:]
    for k in range(n):
        pivot = a[k][k]
        for i in range(k + 1, n):
            f = a[i][k] / pivot
            for j in range(k, n):
                a[i][j] -= f * a[k][j]
            b[i] -= f * b[k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x
