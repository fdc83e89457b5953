"""Past Responses API responses, for `previous_response_id`, GET and DELETE: a bounded
in-memory store, kept apart by cache namespace, least recently used first out of the
largest namespace once it holds `capacity` responses or `max_bytes` bytes.

Touched only from the event loop's thread (handlers are async), so it needs no lock.
A chained response's history shares its Message objects with its predecessor's, so a
long chain costs about one copy of the conversation, not one per response; the bytes are
counted that way too: each message once per namespace however many stored responses
hold it (its text, and its images' encoded bytes: an image is kept encoded with its
digest, never decoded, vision/intake.py), plus each response object's JSON.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.conversation import Conversation, Message
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


DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_MESSAGE_OVERHEAD = 200  # a Message's objects besides its text, roughly


def message_bytes(message: Message) -> int:
    """What keeping `message` costs, roughly: its text, its tool calls' arguments and its
    images' encoded bytes."""
    calls = sum(len(c.name) + len(json.dumps(c.arguments, default=str)) for c in message.tool_calls)
    images = sum(at.image.image.encoded_bytes for at in message.images)
    text = len(message.content) + len(message.reasoning or "")
    return _MESSAGE_OVERHEAD + text + calls + images


@dataclass
class _Space:
    """One namespace's responses, and the messages they hold by object (refcounted)."""

    responses: OrderedDict[str, tuple[StoredResponse, int]] = field(default_factory=OrderedDict)
    # id(message): (the message, how many responses hold it, its bytes)
    messages: dict[int, tuple[Message, int, int]] = field(default_factory=dict)
    nbytes: int = 0

    def hold(self, response_id: str, stored: StoredResponse) -> None:
        own = len(json.dumps(stored.body, default=str))
        self.responses[response_id] = (stored, own)
        self.nbytes += own
        for m in stored.history:
            held = self.messages.get(id(m))
            if held is None:
                held = (m, 0, message_bytes(m))
                self.nbytes += held[2]
            self.messages[id(m)] = (m, held[1] + 1, held[2])

    def release(self, response_id: str) -> bool:
        found = self.responses.pop(response_id, None)
        if found is None:
            return False
        stored, own = found
        self.nbytes -= own
        for m in stored.history:
            _, refs, size = self.messages[id(m)]
            if refs == 1:
                del self.messages[id(m)]
                self.nbytes -= size
            else:
                self.messages[id(m)] = (m, refs - 1, size)
        return True


class ResponseStore:
    """Stored responses by cache namespace (server/guards/namespaces.py): a response is found
    only by a request of the namespace that created it (another's id is a 404, as an id
    never stored), so one extension can neither read, continue nor delete another's.

    `capacity` bounds the responses of all namespaces together, `max_bytes` their bytes
    (module docstring); when one is passed, the namespace holding the most (responses, or
    bytes) gives up its least recently used one. So a client that stores many only evicts
    its own once it holds the largest share: each of k clients keeps at least
    capacity // k of its most recent responses. A response larger than `max_bytes` alone
    is not kept (its id is then a 404, as an evicted one's)."""

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_MAX_BYTES):
        if capacity < 0 or max_bytes < 0:
            raise ValueError("the responses store capacity and bytes must not be negative")
        self.capacity = capacity  # 0: nothing is stored
        self.max_bytes = max_bytes
        self._spaces: dict[str, _Space] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """The bytes held, all namespaces together (module docstring)."""
        return sum(space.nbytes for space in self._spaces.values())

    def held(self, namespace: str) -> int:
        """How many responses `namespace` holds."""
        space = self._spaces.get(namespace)
        return len(space.responses) if space is not None else 0

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        space = self._spaces.get(namespace)
        found = space.responses.get(response_id) if space is not None else None
        if found is None:
            return None
        space.responses.move_to_end(response_id)  # type: ignore[union-attr]
        return found[0]

    def put(self, namespace: str, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0 or self.max_bytes == 0:
            return
        space = self._spaces.setdefault(namespace, _Space())
        self._count -= space.release(response_id)
        space.hold(response_id, stored)
        self._count += 1
        while self._count > self.capacity:
            # The largest share gives one up; on a tie the one storing now does.
            self._pop_oldest(max(self._spaces, key=lambda n: (self.held(n), n == namespace)))
        while self._count and self.nbytes > self.max_bytes:
            spaces = self._spaces
            self._pop_oldest(max(spaces, key=lambda n: (spaces[n].nbytes, n == namespace)))

    def delete(self, namespace: str, response_id: str) -> bool:
        space = self._spaces.get(namespace)
        if space is None or not space.release(response_id):
            return False
        self._count -= 1
        if not space.responses:
            del self._spaces[namespace]
        return True

    def _pop_oldest(self, namespace: str) -> None:
        self.delete(namespace, next(iter(self._spaces[namespace].responses)))
