"""KV forks (beam search): finished requests that keep their KV blocks, and forks from them.

A request sent with ``retain_kv`` keeps its blocks when it finishes normally (stop or
length) until it is aborted. A request sent with ``fork_from`` naming such a request
starts with that request's computed tokens already in its KV: it shares the full blocks
(reference counts) and gets a copy of the partial last one (copy-on-write), which the
runner makes before the next forward (``SchedulerOutput.kv_block_copies``).
"""

from __future__ import annotations

from baton.errors import InvalidRequestError
from baton.kv.manager import KVCacheManager
from baton.request import Request, RequestStatus

#: The finishes that leave a request's KV complete and worth forking from.
_RETAINABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class KVForks:
    """The retained requests by id and the block copies not yet sent to the runner."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.retained: dict[str, Request] = {}
        #: Retained requests whose blocks were taken back under block pressure (until aborted):
        #: a fork from one computes its prefix instead of sharing it.
        self.evicted: set[str] = set()
        self._copies: list[tuple[int, int]] = []

    def retain(self, req: Request) -> bool:
        """Keep a finishing request's blocks if it asked to and finished normally."""
        if not req.retain_kv or req.status not in _RETAINABLE:
            return False
        self.retained[req.request_id] = req
        return True

    def release(self, request_id: str) -> bool:
        """Free a retained request's blocks; False if it holds none."""
        self.evicted.discard(request_id)
        req = self.retained.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def fork(self, child: Request) -> None:
        """Give ``child`` its parent's KV (``child.fork_from``), before it is queued.

        When no block is free for the copy, the child is left to compute its prefix
        like any request (prefix-cache hits included). Raises InvalidRequestError when
        the parent is not retained or its tokens do not begin the child's.
        """
        parent_id = child.fork_from
        assert parent_id is not None
        parent = self.retained.get(parent_id)
        rid = child.request_id
        if parent is None and parent_id in self.evicted:
            return  # its blocks went to requests that needed them: the child computes its prefix
        if parent is None:
            raise InvalidRequestError(
                f"request {rid!r} forks from {parent_id!r}, which is not a finished request "
                "holding its KV: send the parent with retain_kv and fork before aborting it"
            )
        n = parent.num_computed_tokens
        tokens = child.all_token_ids
        if len(tokens) <= n or tokens[:n] != parent.all_token_ids[:n]:
            raise InvalidRequestError(
                f"request {rid!r}'s prompt must extend the {n} computed tokens of {parent_id!r} "
                "it forks from by at least one token"
            )
        if child.lora_key != parent.lora_key or child.cache_salt != parent.cache_salt:
            raise InvalidRequestError(
                f"request {rid!r} forks from {parent_id!r} with another LoRA adapter or cache "
                "salt: their KV differs; fork with the parent's"
            )
        copies = self.kv.fork(parent_id, rid, n)
        if copies is None:
            return
        child.num_computed_tokens = n
        self._copies.extend(copies)

    def evict_one(self) -> bool:
        """Free the oldest retained request's blocks for a request that cannot be admitted
        without them (finished requests must never block the ones waiting); False if none."""
        if not self.retained:
            return False
        rid = next(iter(self.retained))
        self.kv.free(self.retained.pop(rid))
        self.evicted.add(rid)
        return True

    def unfork(self, req: Request) -> None:
        """Give back the blocks a waiting fork holds (it could not be admitted): it computes
        its prefix later like any waiting request. A no-op for a request holding none."""
        if req.fork_from is None or req.status != RequestStatus.WAITING:
            return
        if req.request_id in self.kv.req_to_blocks:
            self.kv.free(req)
            req.num_computed_tokens = 0

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies owed to the runner, once (they go in the next output that reaches it)."""
        copies, self._copies = self._copies, []
        return copies
