"""A radix tree of token sequences: one per model key, values opaque.

Pure Python (no MLX). Edges carry token ids packed as int64 bytes (cache/token_ids.py),
so walking a query compares memory blocks (memcmp) instead of Python ints: a lookup
costs one pass over the matched tokens at C speed, and copies nothing of the query or
of the stored sequences. Siblings differ in their first token. Invariants (checked by
`check_integrity`):
- every node except the root has a non-empty edge label;
- a node without a value has at least two children, unless it is the root
  (so every leaf holds a value and the tree has no dead branches);
- `len(trie)` equals the number of nodes holding a value.
Hence the longest walkable path of a query is its longest common prefix with a
stored sequence.

Not thread-safe: the owner (the store) serialises access.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

from mlx_prefix.cache.token_ids import WIDTH, common_tokens, ids, packed

V = TypeVar("V")

_W = WIDTH  # bytes per packed token id


@dataclass(frozen=True, slots=True)
class TrieEntry(Generic[V]):
    tokens: tuple[int, ...]  # the stored sequence
    value: V


@dataclass(frozen=True, slots=True)
class TriePrefix(Generic[V]):
    length: int  # the stored sequence is query[:length]
    value: V


@dataclass(frozen=True, slots=True)
class TrieMatch(Generic[V]):
    matched: int  # longest common prefix of the query with any stored sequence
    ancestors: tuple[TriePrefix[V], ...]  # stored prefixes of the query, shortest first


@dataclass(frozen=True, slots=True)
class TrieNearest(Generic[V]):
    length: int  # token count of the accepted entry sharing the longest prefix
    value: V  # that entry's value
    common: int  # the prefix it shares with the query (<= length)


@dataclass(frozen=True, slots=True)
class TrieLookup(Generic[V]):
    """`match` and `nearest` of one query, from one walk."""

    match: TrieMatch[V]
    nearest: TrieNearest[V] | None


_MISSING = object()


@dataclass(slots=True, eq=False)
class _Node:
    edge: bytes  # packed label of the edge from the parent (empty for the root)
    children: dict[int, _Node] = field(default_factory=dict)  # first token -> child
    value: object = _MISSING

    @property
    def tokens(self) -> int:
        return len(self.edge) // _W


@dataclass(slots=True)
class _Walk:
    nodes: list[_Node]  # nodes whose whole path is a prefix of the query, root first
    depths: list[int]  # token depth at the end of each node's edge
    partial: tuple[_Node, int] | None  # child entered but left mid-edge, and the depth reached


class _Query:
    """A query's packed bytes and a view of its ids (no copy)."""

    __slots__ = ("raw", "ids")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.raw = packed(tokens)
        self.ids = memoryview(self.raw).cast("q")

    def __len__(self) -> int:
        return len(self.ids)

    def common(self, start: int, edge: bytes) -> int:
        """Tokens in common between the query from token `start` and `edge`: O(common)
        bytes compared, nothing copied (token_ids.common_tokens)."""
        return common_tokens(self.raw, start, edge)


class TokenTrie(Generic[V]):
    def __init__(self) -> None:
        self._root = _Node(edge=b"")
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def insert(self, tokens: Sequence[int], value: V) -> V | None:
        """Store `value` under `tokens` (mutates). Returns the value it replaced, if any."""
        q = _Query(tokens)
        node, pos = self._root, 0
        while pos < len(q):
            child = node.children.get(q.ids[pos])
            if child is None:
                node.children[q.ids[pos]] = _Node(edge=q.raw[pos * _W :], value=value)
                self._size += 1
                return None
            k = q.common(pos, child.edge)
            if k < child.tokens:
                # Split the edge at k: node -> mid -> child.
                mid = _Node(edge=child.edge[: k * _W])
                child.edge = child.edge[k * _W :]
                mid.children[_first(child.edge)] = child
                node.children[q.ids[pos]] = mid
                child = mid
            node, pos = child, pos + k
        prev = node.value
        node.value = value
        if prev is _MISSING:
            self._size += 1
            return None
        return prev  # type: ignore[return-value]

    def get(self, tokens: Sequence[int]) -> V | None:
        """The value stored under exactly `tokens`, or None. Does not mutate."""
        walk = self._walk(_Query(tokens))
        if walk.partial is not None or walk.depths[-1] != len(tokens):
            return None
        value = walk.nodes[-1].value
        return None if value is _MISSING else value  # type: ignore[return-value]

    def remove(self, tokens: Sequence[int]) -> V:
        """Delete the entry under exactly `tokens` (mutates); KeyError if absent.

        Prunes valueless leaves and merges valueless single-child nodes so the
        invariants hold.
        """
        walk = self._walk(_Query(tokens))
        path = walk.nodes
        node = path[-1]
        if walk.partial is not None or walk.depths[-1] != len(tokens) or node.value is _MISSING:
            raise KeyError(tuple(tokens))
        value = node.value
        node.value = _MISSING
        self._size -= 1
        # Fix up at most the node and its parent; everything above was valid.
        for i in (len(path) - 1, len(path) - 2):
            if i <= 0:
                break
            n, parent = path[i], path[i - 1]
            if n.value is not _MISSING:
                break
            first = _first(n.edge)
            if not n.children:
                del parent.children[first]
            elif len(n.children) == 1:
                (only,) = n.children.values()
                only.edge = n.edge + only.edge
                parent.children[first] = only
        return value  # type: ignore[return-value]

    def match(self, tokens: Sequence[int]) -> TrieMatch[V]:
        """Longest common prefix with any stored sequence, and the stored prefixes
        of `tokens` along the way. Does not mutate."""
        return self._match(self._walk(_Query(tokens)))

    def nearest(self, tokens: Sequence[int], accept: Callable[[V], bool]) -> TrieNearest[V] | None:
        """The accepted entry with the longest common prefix with `tokens` (ties: the
        shortest such entry). Does not mutate."""
        return self._nearest(self._walk(_Query(tokens)), accept)

    def lookup(self, tokens: Sequence[int], accept: Callable[[V], bool]) -> TrieLookup[V]:
        """`match(tokens)` and `nearest(tokens, accept)` from one walk. Does not mutate."""
        walk = self._walk(_Query(tokens))
        return TrieLookup(self._match(walk), self._nearest(walk, accept))

    def sharing(self, tokens: Sequence[int]) -> Iterator[tuple[V, int]]:
        """(value, tokens shared) of every entry sharing a prefix with `tokens`, the
        entry stored under exactly `tokens` excepted, deepest first: no later entry
        shares more. Builds no token tuples. Does not mutate; do not mutate while
        iterating."""
        walk = self._walk(_Query(tokens))
        skip = None
        if walk.partial is not None:
            skip, shared = walk.partial
            yield from ((v, shared) for v in self._values_under(skip, None))
        for node, depth in zip(reversed(walk.nodes[1:]), reversed(walk.depths[1:]), strict=True):
            values = self._values_under(node, skip, own=depth < len(tokens))
            yield from ((v, depth) for v in values)
            skip = node

    def items(self) -> Iterator[TrieEntry[V]]:
        """All entries, depth first. Does not mutate; do not mutate while iterating."""
        yield from self._items_under(self._root, b"")

    def extensions(self, tokens: Sequence[int]) -> Iterator[TrieEntry[V]]:
        """Entries that strictly extend `tokens`. Does not mutate."""
        q = _Query(tokens)
        walk = self._walk(q)
        if walk.partial is not None:
            child, shared = walk.partial
            if shared == len(q):
                yield from self._items_under(child, q.raw[: walk.depths[-1] * _W])
            return
        if walk.depths[-1] == len(q):
            for c in walk.nodes[-1].children.values():
                yield from self._items_under(c, q.raw)

    def check_integrity(self) -> None:
        """Assert the structural invariants. Does not mutate."""
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.value is not _MISSING:
                count += 1
            assert len(node.edge) % _W == 0, "edge not whole tokens"
            if node is not self._root:
                assert node.edge, "empty edge label below the root"
                assert node.value is not _MISSING or len(node.children) >= 2, "dead node"
            for first, child in node.children.items():
                assert child.edge and _first(child.edge) == first, "child keyed by wrong token"
                stack.append(child)
        assert count == self._size, f"size {self._size} != {count} stored values"

    # -- internals ---------------------------------------------------------

    def _walk(self, q: _Query) -> _Walk:
        nodes, depths = [self._root], [0]
        node, pos = self._root, 0
        while pos < len(q):
            child = node.children.get(q.ids[pos])
            if child is None:
                break
            k = q.common(pos, child.edge)
            if k < child.tokens:
                return _Walk(nodes, depths, (child, pos + k))
            node, pos = child, pos + k
            nodes.append(node)
            depths.append(pos)
        return _Walk(nodes, depths, None)

    @staticmethod
    def _match(walk: _Walk) -> TrieMatch[V]:
        ancestors = tuple(
            TriePrefix(d, cast(V, n.value))  # not _MISSING: a stored value
            for n, d in zip(walk.nodes, walk.depths, strict=True)
            if n.value is not _MISSING
        )
        matched = walk.partial[1] if walk.partial is not None else walk.depths[-1]
        return TrieMatch(matched=matched, ancestors=ancestors)

    def _nearest(self, walk: _Walk, accept: Callable[[V], bool]) -> TrieNearest[V] | None:
        """Entries below a point at depth d of the query's path share exactly d tokens
        with it (siblings differ in their first token), so search subtrees from the
        deepest point of the path upwards, each excluding the branch already searched."""
        if walk.partial is not None:
            child, shared = walk.partial
            found = self._shortest_accepted(child, None, accept)
            if found is not None:
                length = walk.depths[-1] + child.tokens + found[0]
                return TrieNearest(length, found[1], common=shared)
        skip = walk.partial[0] if walk.partial is not None else None
        for node, depth in zip(reversed(walk.nodes), reversed(walk.depths), strict=True):
            found = self._shortest_accepted(node, skip, accept)
            if found is not None:
                return TrieNearest(depth + found[0], found[1], common=depth)
            skip = node
        return None

    def _items_under(self, node: _Node, prefix: bytes) -> Iterator[TrieEntry[V]]:
        stack = [(node, prefix)]
        while stack:
            n, p = stack.pop()
            raw = p + n.edge
            if n.value is not _MISSING:
                yield TrieEntry(ids(raw), n.value)  # type: ignore[arg-type]
            stack.extend((c, raw) for c in n.children.values())

    @staticmethod
    def _values_under(node: _Node, skip: _Node | None, own: bool = True) -> Iterator[V]:
        """Values in `node`'s subtree but not in `skip`'s; `own`: `node`'s value too."""
        if own and node.value is not _MISSING:
            yield node.value  # type: ignore[misc]
        stack = [c for c in node.children.values() if c is not skip]
        while stack:
            n = stack.pop()
            if n.value is not _MISSING:
                yield n.value  # type: ignore[misc]
            stack.extend(n.children.values())

    @staticmethod
    def _shortest_accepted(
        node: _Node, skip: _Node | None, accept: Callable[[V], bool]
    ) -> tuple[int, V] | None:
        """Shortest accepted entry in `node`'s subtree (excluding `skip`'s subtree), as
        (tokens after the node, value). Depth first, pruning paths no shorter than the
        best found."""
        best: tuple[int, V] | None = None
        stack: list[tuple[_Node, int]] = [(node, 0)]
        while stack:
            n, extra = stack.pop()
            if best is not None and extra >= best[0]:
                continue
            if n.value is not _MISSING and accept(n.value):  # type: ignore[arg-type]
                best = (extra, n.value)  # type: ignore[assignment]
                continue
            for c in n.children.values():
                if c is not skip:
                    stack.append((c, extra + c.tokens))
        return best


def _first(edge: bytes) -> int:
    return int.from_bytes(edge[:_W], sys.byteorder, signed=True)
