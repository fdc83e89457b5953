"""Token sequences packed as int64 bytes (native byte order), which the prompt trie
(cache/trie.py) compares with memcmp instead of Python ints."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence


class TokenIds(tuple):
    """A tuple of token ids that also holds them packed (`packed`: int64 bytes), built
    once per prompt (at render time, in the caller's thread) so that every trie lookup
    of it compares memory without converting it. Equal to, and hashes like, the plain
    tuple; slices are plain tuples."""

    packed: bytes

    def __new__(cls, tokens: Sequence[int] = ()) -> TokenIds:
        self = super().__new__(cls, tokens)
        self.packed = _pack(self)
        return self


def packed(tokens: Sequence[int]) -> bytes:
    """`tokens` as int64 bytes: free for TokenIds, one conversion otherwise."""
    return tokens.packed if isinstance(tokens, TokenIds) else _pack(tokens)


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"{len(tokens)}q", *tokens)  # the fastest pure-Python packing


def ids(raw: bytes) -> tuple[int, ...]:
    a = array("q")
    a.frombytes(raw)
    return tuple(a)
