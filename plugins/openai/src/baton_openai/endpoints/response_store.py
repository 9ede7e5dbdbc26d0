"""The Responses API's stored responses: bounded in memory by size and by age.

A response created with ``store: true`` is kept with the conversation it ended (its
input and output as chat messages, the instructions left out, as OpenAI does), so a
later request's ``previous_response_id`` continues it and GET /v1/responses/{id} returns
it. ``server.response_store_max_bytes`` bounds what is kept (each entry's size is its
JSON's): past it, the oldest entries go; ``server.response_store_ttl`` is how long one
stays. Nothing outlives the process.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from baton_openai.protocol.openai import ChatMessage
from baton_openai.protocol.responses import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    #: The conversation up to and including this response's output, without instructions.
    history: list[ChatMessage]
    size: int
    stored_at: float = field(default_factory=time.monotonic)


class ResponseStore:
    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, history: list[ChatMessage]) -> bool:
        """Keep a response; False when it alone is larger than the store (not kept)."""
        size = len(response.model_dump_json()) + sum(len(m.model_dump_json()) for m in history)
        self._expire()
        if size > self.max_bytes:
            return False
        self.delete(response.id)
        while self._entries and self.bytes + size > self.max_bytes:
            self._pop_oldest()
        self._entries[response.id] = StoredResponse(response, history, size)
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def _expire(self) -> None:
        """Drop the entries older than the ttl (the oldest are first)."""
        cutoff = time.monotonic() - self.ttl
        while self._entries and next(iter(self._entries.values())).stored_at < cutoff:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size
