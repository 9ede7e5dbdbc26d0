"""Speculative decoding's acceptance figures summed over an interval.

The engine's ``SchedulerStats`` carry each step's figures (``spec_num_drafts``:
verifications, ``spec_num_draft_tokens``, ``spec_num_accepted_tokens``,
``spec_accepted_per_position``); a ``SpecTally`` sums them for one engine and
derives what a reader wants: the acceptance rate (accepted / proposed), the mean
accepted length (tokens a verification yields: 1 + accepted / verifications,
the model's own token included, as vLLM counts it) and the acceptance at each
draft position (verifications that accepted that position / verifications).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.protocol import SchedulerStats


@dataclass(slots=True)
class SpecTally:
    """Acceptance figures of one engine, summed from per-step ``SchedulerStats``."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def verified(self, num_proposed: int, num_accepted: int) -> None:
        """Count one verification that kept ``num_accepted`` of ``num_proposed`` drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_position
        if num_accepted > len(per_pos):
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def add(self, stats: SchedulerStats) -> None:
        """Add one step's figures (deltas)."""
        self.num_drafts += stats.spec_num_drafts
        self.num_draft_tokens += stats.spec_num_draft_tokens
        self.num_accepted_tokens += stats.spec_num_accepted_tokens
        per_pos = stats.spec_accepted_per_position or []
        if len(per_pos) > len(self.accepted_per_position):
            self.accepted_per_position.extend(
                [0] * (len(per_pos) - len(self.accepted_per_position))
            )
        for i, n in enumerate(per_pos):
            self.accepted_per_position[i] += n

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed ones (0 with none proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens one verification yields on average: the accepted drafts + the model's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """For each draft position, the share of verifications that accepted it."""
        if not self.num_drafts:
            return [0.0] * len(self.accepted_per_position)
        return [n / self.num_drafts for n in self.accepted_per_position]

    def describe(self) -> str:
        """One line's worth: the rates, the mean length and the counts behind them."""
        per_pos = ", ".join(f"{r:.2f}" for r in self.per_position_acceptance)
        return (
            f"acceptance rate {100 * self.acceptance_rate:.1f}%, mean accepted length "
            f"{self.mean_accepted_length:.2f} tokens per verification, per-position acceptance "
            f"[{per_pos}], verifications {self.num_drafts}, draft tokens "
            f"{self.num_draft_tokens}, accepted {self.num_accepted_tokens}"
        )
