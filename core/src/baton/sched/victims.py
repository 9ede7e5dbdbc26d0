"""Preemption victims with the data to choose one: what each candidate would cost to preempt.

When a running request needs a KV block and none is free, the scheduler asks
the policy for a victim. A policy with ``choose_victim(candidates, now)``
(``baton.interfaces.VictimAwarePolicy``) gets one ``VictimCandidate`` per
running request that is not in flight, in admission order: the tokens it has
computed (what recomputing it redoes after the preemption), the KV blocks it
holds (what preempting it frees), its progress, and whether it is the request
asking for the block. A policy without it gets ``select_victim(running)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from baton.request import Request


class VictimCandidate(msgspec.Struct, frozen=True, kw_only=True):
    """One running request the scheduler could preempt, and what that would cost."""

    #: The request (read-only to the policy).
    request: Any
    #: Tokens whose KV it holds: recomputing it after a preemption redoes them.
    num_computed_tokens: int
    #: KV blocks it holds (shared prefix-cache blocks included): what preempting it frees, at most.
    num_blocks: int
    #: Output tokens it has produced, and its cap (``max_tokens``): its progress.
    num_output_tokens: int
    max_tokens: int
    #: Whether it is the request that needs the block (choosing it makes it yield).
    is_requester: bool = False


def candidates(
    running: Sequence[Request], requester: Request, block_ids: Any
) -> list[VictimCandidate]:
    """The candidates' data; ``block_ids(request_id)`` lists the blocks a request holds."""
    return [
        VictimCandidate(
            request=r,
            num_computed_tokens=r.num_computed_tokens,
            num_blocks=len(block_ids(r.request_id)),
            num_output_tokens=r.num_output_tokens,
            max_tokens=r.max_tokens,
            is_requester=r is requester,
        )
        for r in running
    ]
