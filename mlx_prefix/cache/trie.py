"""A radix tree of token sequences: one per model key, values opaque.

Pure Python (no MLX). Edges carry token tuples; siblings differ in their first
token. Invariants (checked by `check_integrity`):
- every node except the root has a non-empty edge label;
- a node without a value has at least two children, unless it is the root
  (so every leaf holds a value and the tree has no dead branches);
- `len(trie)` equals the number of nodes holding a value.
Hence the longest walkable path of a query is its longest common prefix with a
stored sequence.

Not thread-safe: the owner (the store) serialises access.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


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
    entry: TrieEntry[V]  # the accepted entry sharing the longest prefix with the query
    common: int  # that shared prefix length (<= len(entry.tokens))


_MISSING = object()


@dataclass(slots=True, eq=False)
class _Node:
    edge: tuple[int, ...]  # label of the edge from the parent (empty for the root)
    children: dict[int, _Node] = field(default_factory=dict)  # first token -> child
    value: object = _MISSING


@dataclass(slots=True)
class _Walk:
    nodes: list[_Node]  # nodes whose whole path is a prefix of the query, root first
    depths: list[int]  # token depth at the end of each node's edge
    partial: tuple[_Node, int] | None  # child entered but left mid-edge, and the depth reached


def _common(a: Sequence[int], start: int, edge: tuple[int, ...]) -> int:
    """Length of the common prefix of a[start:] and edge."""
    n = min(len(edge), len(a) - start)
    i = 0
    # Compare blocks at C speed (edges run to tens of thousands of tokens), then
    # find the divergence inside the first differing block.
    block = 512
    while i + block <= n and tuple(a[start + i : start + i + block]) == edge[i : i + block]:
        i += block
    while i < n and a[start + i] == edge[i]:
        i += 1
    return i


class TokenTrie(Generic[V]):
    def __init__(self) -> None:
        self._root = _Node(edge=())
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def insert(self, tokens: Sequence[int], value: V) -> V | None:
        """Store `value` under `tokens` (mutates). Returns the value it replaced, if any."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                node.children[tokens[pos]] = _Node(edge=tuple(tokens[pos:]), value=value)
                self._size += 1
                return None
            k = _common(tokens, pos, child.edge)
            if k < len(child.edge):
                # Split the edge at k: node -> mid -> child.
                mid = _Node(edge=child.edge[:k])
                child.edge = child.edge[k:]
                mid.children[child.edge[0]] = child
                node.children[mid.edge[0]] = mid
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
        node, pos = self._find(tokens)
        if node is None or pos != len(tokens) or node.value is _MISSING:
            return None
        return node.value  # type: ignore[return-value]

    def remove(self, tokens: Sequence[int]) -> V:
        """Delete the entry under exactly `tokens` (mutates); KeyError if absent.

        Prunes valueless leaves and merges valueless single-child nodes so the
        invariants hold.
        """
        path: list[_Node] = [self._root]
        pos = 0
        while pos < len(tokens):
            child = path[-1].children.get(tokens[pos])
            if child is None or _common(tokens, pos, child.edge) != len(child.edge):
                raise KeyError(tuple(tokens))
            path.append(child)
            pos += len(child.edge)
        node = path[-1]
        if pos != len(tokens) or node.value is _MISSING:
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
            if not n.children:
                del parent.children[n.edge[0]]
            elif len(n.children) == 1:
                (only,) = n.children.values()
                only.edge = n.edge + only.edge
                parent.children[only.edge[0]] = only
        return value  # type: ignore[return-value]

    def match(self, tokens: Sequence[int]) -> TrieMatch[V]:
        """Longest common prefix with any stored sequence, and the stored prefixes
        of `tokens` along the way. Does not mutate."""
        walk = self._walk(tokens)
        ancestors = tuple(
            TriePrefix(d, n.value)  # type: ignore[arg-type]
            for n, d in zip(walk.nodes, walk.depths, strict=True)
            if n.value is not _MISSING
        )
        matched = walk.partial[1] if walk.partial is not None else walk.depths[-1]
        return TrieMatch(matched=matched, ancestors=ancestors)

    def nearest(self, tokens: Sequence[int], accept: Callable[[V], bool]) -> TrieNearest[V] | None:
        """The accepted entry with the longest common prefix with `tokens` (ties: the
        shortest such entry). Does not mutate.

        Entries below a point at depth d of the query's path share exactly d tokens
        with it (siblings differ in their first token), so search subtrees from the
        deepest point of the path upwards, each excluding the branch already searched.
        """
        walk = self._walk(tokens)
        if walk.partial is not None:
            child, shared = walk.partial
            found = self._shortest_accepted(child, None, accept)
            if found is not None:
                base = tuple(tokens[: walk.depths[-1]]) + child.edge
                return TrieNearest(TrieEntry(base + found[0], found[1]), common=shared)
        skip = walk.partial[0] if walk.partial is not None else None
        for node, depth in zip(reversed(walk.nodes), reversed(walk.depths), strict=True):
            found = self._shortest_accepted(node, skip, accept)
            if found is not None:
                return TrieNearest(TrieEntry(tuple(tokens[:depth]) + found[0], found[1]), depth)
            skip = node
        return None

    def items(self) -> Iterator[TrieEntry[V]]:
        """All entries, depth first. Does not mutate; do not mutate while iterating."""
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            tokens = prefix + node.edge
            if node.value is not _MISSING:
                yield TrieEntry(tokens, node.value)  # type: ignore[arg-type]
            stack.extend((c, tokens) for c in node.children.values())

    def extensions(self, tokens: Sequence[int]) -> Iterator[TrieEntry[V]]:
        """Entries that strictly extend `tokens`. Does not mutate."""
        walk = self._walk(tokens)
        if walk.partial is not None:
            child, shared = walk.partial
            if shared == len(tokens):
                yield from self._items_under(child, tuple(tokens[: walk.depths[-1]]))
            return
        if walk.depths[-1] == len(tokens):
            node = walk.nodes[-1]
            for c in node.children.values():
                yield from self._items_under(c, tuple(tokens))

    def check_integrity(self) -> None:
        """Assert the structural invariants. Does not mutate."""
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.value is not _MISSING:
                count += 1
            if node is not self._root:
                assert node.edge, "empty edge label below the root"
                assert node.value is not _MISSING or len(node.children) >= 2, "dead node"
            for first, child in node.children.items():
                assert child.edge and child.edge[0] == first, "child keyed by wrong token"
                stack.append(child)
        assert count == self._size, f"size {self._size} != {count} stored values"

    # -- internals ---------------------------------------------------------

    def _find(self, tokens: Sequence[int]) -> tuple[_Node | None, int]:
        """The node reached by consuming whole edges of `tokens`."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or _common(tokens, pos, child.edge) != len(child.edge):
                return None, pos
            node, pos = child, pos + len(child.edge)
        return node, pos

    def _walk(self, tokens: Sequence[int]) -> _Walk:
        nodes, depths = [self._root], [0]
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(tokens, pos, child.edge)
            if k < len(child.edge):
                return _Walk(nodes, depths, (child, pos + k))
            node, pos = child, pos + k
            nodes.append(node)
            depths.append(pos)
        return _Walk(nodes, depths, None)

    def _items_under(self, node: _Node, prefix: tuple[int, ...]) -> Iterator[TrieEntry[V]]:
        stack = [(node, prefix)]
        while stack:
            n, p = stack.pop()
            tokens = p + n.edge
            if n.value is not _MISSING:
                yield TrieEntry(tokens, n.value)  # type: ignore[arg-type]
            stack.extend((c, tokens) for c in n.children.values())

    @staticmethod
    def _shortest_accepted(
        node: _Node, skip: _Node | None, accept: Callable[[V], bool]
    ) -> tuple[tuple[int, ...], V] | None:
        """Shortest accepted entry in `node`'s subtree (excluding `skip`'s subtree),
        as (tokens after the node, value). Depth first, pruning paths no shorter than
        the best found."""
        best: tuple[tuple[int, ...], V] | None = None
        stack: list[tuple[_Node, tuple[int, ...]]] = [(node, ())]
        while stack:
            n, extra = stack.pop()
            if best is not None and len(extra) >= len(best[0]):
                continue
            if n.value is not _MISSING and accept(n.value):  # type: ignore[arg-type]
                best = (extra, n.value)  # type: ignore[assignment]
                continue
            for c in n.children.values():
                if c is not skip:
                    stack.append((c, extra + c.edge))
        return best
