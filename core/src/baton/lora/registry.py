"""The engine core's LoRA adapters: which are loaded in the workers (least recently used
first), which are pinned, and the prefix-cache key of each; the utility calls add / remove /
list / pin, and loading a request's adapter when it is new."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from baton.config import LoRASection
from baton.errors import InvalidRequestError, error_from_message
from baton.interfaces import Executor
from baton.lora.request import LoRARequest, as_lora_request

if TYPE_CHECKING:
    from baton.sched.scheduler import Scheduler

log = logging.getLogger(__name__)


def lora_rpc(worker: object, method: str, args: tuple[object, ...]) -> tuple[bool, object]:
    """In a worker: ``(True, result)`` of ``worker.<method>(*args)`` (add_lora, remove_lora,
    list_loras), or ``(False, "Type: message")``: a bad adapter fails the call, not the worker."""
    try:
        return True, getattr(worker, method)(*args)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"


class EngineLoras:
    """The adapters of one engine core, loaded into every worker through ``collective_rpc``;
    ``scheduler`` tells which ones unfinished requests use (never dropped nor removed)."""

    def __init__(self, settings: LoRASection, executor: Executor, scheduler: Scheduler) -> None:
        self.settings = settings
        self.executor = executor
        self.scheduler = scheduler
        #: loaded adapters by id, least recently used first; pinned ones are never dropped to
        #: make room (lora.max_cpu_loras)
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        self.pinned: set[int] = set()
        #: id -> (the adapter last registered under it, its registration): the prefix cache's key
        self._registrations: dict[int, tuple[LoRARequest, int]] = {}

    def check_enabled(self) -> None:
        if not self.settings.enable_lora:
            raise InvalidRequestError(
                "LoRA adapters are off: start the engine with lora.enable_lora = true "
                "(--enable-lora, LLM(enable_lora=True))",
                param="lora_request",
            )

    def use(self, lora: Any) -> str:
        """A request's adapter, loaded if it is not: its prefix-cache key."""
        self.check_enabled()
        lora = as_lora_request(lora)
        if not self._registered(lora):
            self.add(lora)
        return self._key(lora.lora_int_id)

    def add(self, lora_request: Any) -> bool:
        """Load an adapter into every worker (read and checked against the model); False if it
        is loaded already."""
        self.check_enabled()
        lora = as_lora_request(lora_request)
        if self._registered(lora):
            return False
        self._make_room()
        self._rpc("add_lora", lora)
        lid = lora.lora_int_id
        self.loaded[lid] = lora
        prev = self._registrations.get(lid)
        gen = 0 if prev is None else prev[1] + (prev[0] != lora)
        self._registrations[lid] = (lora, gen)
        return True

    def remove(self, lora_id: int) -> bool:
        """Drop an adapter from every worker; False if it was not loaded. Refused while an
        unfinished request uses it."""
        self.check_enabled()
        if type(lora_id) is not int:
            raise InvalidRequestError(f"lora_id must be an int, got {lora_id!r}", param="lora_id")
        if lora_id not in self.loaded:
            return False
        n = sum(1 for r in self.scheduler.requests.values() if r.lora_id == lora_id)
        if n:
            raise InvalidRequestError(
                f"LoRA adapter id {lora_id} is used by {n} unfinished request(s): wait for them "
                "or abort them, then remove it",
                param="lora_id",
            )
        self._rpc("remove_lora", lora_id)
        del self.loaded[lora_id]
        self.pinned.discard(lora_id)
        return True

    def ids(self) -> list[int]:
        """The ids of the loaded adapters."""
        return sorted(self.loaded)

    def pin(self, lora_id: int) -> bool:
        """Keep a loaded adapter loaded: never dropped to make room for another."""
        self.check_enabled()
        if lora_id not in self.loaded:
            raise InvalidRequestError(
                f"LoRA adapter id {lora_id!r} is not loaded: add_lora it first", param="lora_id"
            )
        self.pinned.add(lora_id)
        return True

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        outcomes = self.executor.collective_rpc(lora_rpc, (method, args))
        for rank, (ok, value) in enumerate(outcomes):
            if not ok:
                text = str(value)
                if len(outcomes) > 1:
                    kind, _, rest = text.partition(": ")
                    text = f"{kind}: worker {rank}: {rest}"
                raise error_from_message(text)
        return [value for _, value in outcomes]

    def _registered(self, lora: LoRARequest) -> bool:
        """True if ``lora`` is loaded (now the most recently used); False if its id is free.
        An id loaded for another adapter is refused."""
        known = self.loaded.get(lora.lora_int_id)
        if known is None:
            return False
        if known != lora:
            raise InvalidRequestError(
                f"LoRA id {lora.lora_int_id} is loaded as adapter {known.lora_name!r} "
                f"({known.lora_path}); adapter {lora.lora_name!r} ({lora.lora_path}) needs an id "
                "of its own (or remove_lora the other first)",
                param="lora_request",
            )
        self.loaded.move_to_end(lora.lora_int_id)
        return True

    def _key(self, lora_id: int) -> str:
        """The adapter's part of its requests' block hashes: its id, and which adapter was
        registered under that id (an id re-used for another folder gets fresh hashes)."""
        gen = self._registrations[lora_id][1]
        return str(lora_id) if gen == 0 else f"{lora_id}.{gen}"

    def _make_room(self) -> None:
        """Drop least recently used adapters, unpinned and used by no unfinished request, until
        one more fits in lora.max_cpu_loras (none can be dropped: it goes over, for a while)."""
        limit = self.settings.max_cpu_loras or self.settings.max_loras
        if len(self.loaded) < limit:
            return
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        for lid in list(self.loaded):
            if len(self.loaded) < limit:
                return
            if lid not in self.pinned and lid not in in_use:
                self._rpc("remove_lora", lid)
                del self.loaded[lid]
                log.info(
                    "LoRA adapter id %d dropped to make room (lora.max_cpu_loras=%d)", lid, limit
                )
