"""How often a stored prefix has served a request: the frequency the value policy weighs.

A conversation's entries come and go turn by turn (its next turn stores a longer entry,
and the shorter one is dropped as redundant or handed over to that turn: handover.py),
so a count kept on one entry would restart at 0 every turn: a main agent's prefix,
restored on every one of its turns, would look as new as a subagent's one-shot turn.
Here a restore counts on the entry restored, when it reused at least INHERIT_SHARE of it
(a head many one-shot prompts share is no use of the entry: contents.py), and on every
stored entry it extends (their tokens were reused too), and is remembered for the
restored prefix itself (`Lineage`):
an entry stored later under that prefix (the turn's own end) starts with its count when
the prefix is at least INHERIT_SHARE of it. A
request that restores a prefix reused k times before makes it k + 1.

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from collections import OrderedDict

from mlx_prefix.cache.token_ids import TokenIds
from mlx_prefix.cache.trie import TokenTrie

# Restored prefixes remembered (the newest): enough for every conversation a server
# keeps between two of its turns; an older one only restarts its count.
LINEAGE_SIZE = 256
# A new entry inherits the count of its longest restored prefix only when that prefix is
# at least this share of it: a conversation's next turn (it extends the last restore by
# a few messages), not a one-shot that shares a short system prompt with many others
# (which would make every one-shot frequent: the value policy's frequent segment).
INHERIT_SHARE = 0.3


class Lineage:
    def __init__(self, size: int = LINEAGE_SIZE) -> None:
        self._size = size
        self._tries: dict[str, TokenTrie[int]] = {}  # model key -> restored prefix -> uses
        # (model key, packed prefix) -> the prefix, oldest first (bytes hash once, cached)
        self._order: OrderedDict[tuple[str, bytes], TokenIds] = OrderedDict()

    def restored(self, model_key: str, prefix: TokenIds, uses: int) -> None:
        """A request restored `prefix`, now reused `uses` times (mutates)."""
        trie = self._tries.setdefault(model_key, TokenTrie())
        old = trie.insert(prefix, uses)
        if old is not None:
            trie.insert(prefix, max(old, uses))
        self._order[(model_key, prefix.packed)] = prefix
        self._order.move_to_end((model_key, prefix.packed))
        while len(self._order) > self._size:
            (key, _), oldest = self._order.popitem(last=False)
            self._tries[key].remove(oldest)
            if not len(self._tries[key]):
                del self._tries[key]

    def inherited(self, model_key: str, key: TokenIds) -> int:
        """The uses of the longest remembered prefix of `key` (0: none). Does not mutate."""
        trie = self._tries.get(model_key)
        if trie is None:
            return 0
        ancestors = trie.match(key).ancestors
        if not ancestors or ancestors[-1].length < INHERIT_SHARE * len(key):
            return 0
        return ancestors[-1].value

    def __len__(self) -> int:
        return len(self._order)
