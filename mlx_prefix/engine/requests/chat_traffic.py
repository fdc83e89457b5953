"""Which clients are chats, learned from the traffic: first turns worth a prefetch.

The next-turn prefetch (prefetch.py) needs a reply to come back. A request with a
reply in its history shows it; a chat's first turn looks like a one-shot request (a
browser extension's single instruction) and the client sends no flag telling them
apart. So: every reply the engine gives is remembered by the conversation it ended
(a digest of the messages plus the reply); a later request whose history holds that
conversation with that reply sent back proves its client continues conversations.
The client is known by its system prompt and tools (what a chat app sends with every
conversation); its next first turns are prefetched. A one-shot client never sends a
reply back, so it never qualifies; nor does a request without a system prompt, which
has nothing to tell its client apart by.

Digests only (no texts kept), bounded LRU sets. Engine thread only.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from mlx_prefix.conversation import Message
from mlx_prefix.records import PromptInput

MAX_REPLIES = 4096  # replies remembered
MAX_CLIENTS = 1024  # chat clients remembered


def _canonical(message: Message) -> bytes:
    content = message.content.strip()  # clients trim what they display and send back
    return json.dumps([message.role, content], sort_keys=True).encode()


def _chain(messages: Sequence[Message], scope: bytes) -> Iterator[bytes]:
    """The digest of each prefix of `messages`: messages[:1], messages[:2], ..."""
    h = hashlib.sha256(scope)
    for m in messages:
        h.update(_canonical(m))
        yield h.copy().digest()


def client_key(source: PromptInput) -> bytes | None:
    """What tells a client apart: its system prompt and tools; None without a system
    prompt."""
    messages = source.messages or ()
    if not messages or messages[0].role != "system":
        return None
    tools = json.dumps(source.tools, sort_keys=True, default=str) if source.tools else ""
    return hashlib.sha256(_canonical(messages[0]) + tools.encode()).digest()


class ChatTraffic:
    def __init__(self) -> None:
        self._replies: OrderedDict[bytes, None] = OrderedDict()  # conversation + reply
        self._chats: OrderedDict[bytes, None] = OrderedDict()  # client keys

    def finished(self, source: PromptInput, reply: str, scope: str = "") -> bool:
        """A request got `reply` (mutates). Returns whether it is a first turn (no reply
        in its history) of a client seen continuing a conversation before: then the
        next turn is worth prefetching. What one cache namespace (`scope`: the request's
        entry key) teaches never applies to another's requests (invariant 10)."""
        if source.messages is None:
            return False
        messages = list(source.messages)
        seed = scope.encode()
        own = client_key(source)
        key = hashlib.sha256(seed + own).digest() if own is not None else None
        digests = list(_chain([*messages, Message("assistant", reply)], seed))
        _remember(self._replies, digests[-1], MAX_REPLIES)
        sent_back = [digests[i] for i, m in enumerate(messages) if m.role == "assistant"]
        if any(d in self._replies for d in sent_back) and key is not None:
            _remember(self._chats, key, MAX_CLIENTS)  # one of our replies came back
        return not sent_back and key is not None and key in self._chats

    @property
    def chat_clients(self) -> int:
        return len(self._chats)


def _remember(lru: OrderedDict[bytes, None], key: bytes, limit: int) -> None:
    lru[key] = None
    lru.move_to_end(key)
    while len(lru) > limit:
        lru.popitem(last=False)
