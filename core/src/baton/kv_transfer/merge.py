"""Several workers' connector reports merged into the one the scheduler half sees.

Each worker half reports its own loads and saves, possibly in different steps (a background
load ends when it ends). ``KVOutputMerger`` keeps the partial counts across steps: a load
counts as finished once every worker reported it, with the fewest tokens any worker loaded
(a block one shard lacks is a block the request lacks); a save likewise once every worker
confirmed it. A request any worker failed fails (and nothing more is awaited for it); the
first ``step_error`` stands for the step; the workers' figures add up.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.protocol import KVConnectorOutput, KVTransferStats


class KVOutputMerger:
    """The merged reports of ``num_workers`` worker halves (see the module docstring)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        #: request id -> tokens each worker that reported the load loaded
        self._loads: dict[str, list[int]] = {}
        #: request id -> workers that reported its saves finished
        self._saves: dict[str, int] = {}

    def merge(self, reports: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's reports, one per worker (None: nothing to report); None when the merge
        has nothing to say yet."""
        out = KVConnectorOutput()
        stats: list[KVTransferStats] = []
        for report in reports:
            if report is None:
                continue
            for rid, n in report.finished_loading.items():
                self._loads.setdefault(rid, []).append(n)
            for rid in report.finished_saving:
                self._saves[rid] = self._saves.get(rid, 0) + 1
            out.failed.update(report.failed)
            if out.step_error is None:
                out.step_error = report.step_error
            if report.stats is not None:
                stats.append(report.stats)
        for rid in out.failed:
            self._loads.pop(rid, None)
            self._saves.pop(rid, None)
        for rid, loaded in list(self._loads.items()):
            if len(loaded) >= self.num_workers:
                out.finished_loading[rid] = min(loaded)
                del self._loads[rid]
        for rid, count in list(self._saves.items()):
            if count >= self.num_workers:
                out.finished_saving.append(rid)
                del self._saves[rid]
        out.stats = sum_stats(stats) if stats else None
        if not (out.finished_loading or out.finished_saving or out.failed or out.stats):
            return out if out.step_error is not None else None
        return out


def sum_stats(parts: Sequence[KVTransferStats]) -> KVTransferStats:
    """Figures of several workers added up: bytes, seconds and tier levels (each worker holds
    its own shard of every tier); tokens served are the most any worker served (every shard
    serves the same tokens)."""
    total = KVTransferStats()
    for s in parts:
        for tier, n in s.hit_tokens.items():
            total.hit_tokens[tier] = max(total.hit_tokens.get(tier, 0), n)
        for field in ("tier_bytes", "tier_capacity_bytes"):
            mine: dict[str, int] = getattr(total, field)
            for tier, n in getattr(s, field).items():
                mine[tier] = mine.get(tier, 0) + n
        total.load_bytes += s.load_bytes
        total.load_seconds += s.load_seconds
        total.save_bytes += s.save_bytes
        total.save_seconds += s.save_seconds
        total.failed_loads += s.failed_loads
    return total
