"""Token sequences packed as int64 bytes (native byte order), which the prompt trie
(cache/trie.py) compares with memcmp instead of Python ints."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

WIDTH = 8  # bytes per packed token id (int64, native byte order)
_BLOCK = 32 * 1024  # bytes compared per call before galloping on


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


def common_tokens(raw: bytes, start: int, other: bytes) -> int:
    """Token ids in common between `raw` from token `start` and `other` (both packed):
    blocks of growing size compared in place, then a binary search inside the first
    differing block. O(common) bytes compared (memcmp), nothing copied."""
    b = start * WIDTH
    n = min(len(other), len(raw) - b)
    view = memoryview(other)
    lo, step = 0, _BLOCK
    while lo < n:
        hi = min(n, lo + step)
        if not raw.startswith(view[lo:hi], b + lo):
            break
        lo, step = hi, step * 2
    else:
        return n // WIDTH
    while hi - lo > 1:  # view[:lo] matches, view[:hi] does not
        mid = (lo + hi) // 2
        if raw.startswith(view[lo:mid], b + lo):
            lo = mid
        else:
            hi = mid
    return lo // WIDTH
