"""Past Responses API responses, for `previous_response_id`, GET and DELETE: a bounded
in-memory store, least recently used first out once it holds `capacity` responses.

Touched only from the event loop's thread (handlers are async), so it needs no lock.
A chained response's history shares its message dicts with its predecessor's, so a long
chain costs about one copy of the conversation, not one per response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlx_prefix.errors import MlxPrefixError


class ResponseNotFound(MlxPrefixError):
    """OpenAI's 404 for an id it does not hold (never stored, evicted or deleted)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    # The conversation it ends, as chat messages: every input (its predecessors' too,
    # instructions excepted: they are not carried over) and its own reply.
    history: tuple[dict[str, Any], ...]


class ResponseStore:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("the responses store capacity must not be negative")
        self.capacity = capacity  # 0: nothing is stored
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
