"""Past Responses API responses, for `previous_response_id`, GET and DELETE: a bounded
in-memory store, kept apart by cache namespace, least recently used first out of the
largest namespace once it holds `capacity` responses.

Touched only from the event loop's thread (handlers are async), so it needs no lock.
A chained response's history shares its message dicts with its predecessor's, so a long
chain costs about one copy of the conversation, not one per response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlx_prefix.conversation import Conversation
from mlx_prefix.errors import MlxPrefixError


class ResponseNotFound(MlxPrefixError):
    """OpenAI's 404 for an id it does not hold (never stored, evicted or deleted)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    # The conversation it ends: every input (its predecessors' too, instructions
    # excepted: they are not carried over) and its own reply.
    history: Conversation


class ResponseStore:
    """Stored responses by cache namespace (server/guards/namespaces.py): a response is found
    only by a request of the namespace that created it (another's id is a 404, as an id
    never stored), so one extension can neither read, continue nor delete another's.

    `capacity` bounds the responses of all namespaces together; when it is reached, the
    namespace holding the most gives up its least recently used one. So a client that
    stores many only evicts its own once it holds the largest share: each of k clients
    keeps at least capacity // k of its most recent responses."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("the responses store capacity must not be negative")
        self.capacity = capacity  # 0: nothing is stored
        self._spaces: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def held(self, namespace: str) -> int:
        """How many responses `namespace` holds."""
        return len(self._spaces.get(namespace, ()))

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        space = self._spaces.get(namespace)
        stored = space.get(response_id) if space is not None else None
        if stored is not None:
            space.move_to_end(response_id)  # type: ignore[union-attr]
        return stored

    def put(self, namespace: str, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        space = self._spaces.setdefault(namespace, OrderedDict())
        self._count += response_id not in space
        space[response_id] = stored
        space.move_to_end(response_id)
        while self._count > self.capacity:
            # The largest share gives one up; on a tie the one storing now does.
            largest = max(self._spaces, key=lambda n: (len(self._spaces[n]), n == namespace))
            self._pop_oldest(largest)

    def delete(self, namespace: str, response_id: str) -> bool:
        space = self._spaces.get(namespace)
        if space is None or space.pop(response_id, None) is None:
            return False
        self._count -= 1
        if not space:
            del self._spaces[namespace]
        return True

    def _pop_oldest(self, namespace: str) -> None:
        space = self._spaces[namespace]
        space.popitem(last=False)
        self._count -= 1
        if not space:
            del self._spaces[namespace]
