"""The reuse rules (invariant 3): which stored sequence serves a request best.

One rule for both tiers: the memory store (`store`) and the disk index
(`disk/index.py`) each keep a trie per model key, with their own values.
Pure Python (no MLX).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from mlx_prefix.cache.trie import TokenTrie

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Reuse(Generic[V]):
    value: V | None  # trie value of the entry to restore (None: nothing usable)
    reuse_tokens: int  # tokens the request gets (after trim/alignment); 0 when None
    trim: int  # tokens to drop from the entry's end when restoring
    matched_tokens: int  # longest common prefix with any stored sequence (diagnostic)


def best_reuse(
    trie: TokenTrie[V],
    tokens: Sequence[int],
    align: Callable[[int], int],
    trimmable: Callable[[V], bool],
) -> Reuse[V]:
    """The stored entry giving the longest reuse for `tokens`. Does not mutate.

    `align(n)` is the largest grid position <= n. Trimmable entries reuse their common
    prefix with `tokens`, aligned and capped at len(tokens) - 1; non-trimmable entries
    only when their whole sequence is a prefix of `tokens`, at most len(tokens) - 1
    long, and on the grid. Ties go to the smaller trim.
    """
    if not len(trie):
        return Reuse(None, 0, 0, 0)
    limit = len(tokens) - 1  # leave at least one token to compute
    found = trie.lookup(tokens, trimmable)  # one walk; pass TokenIds to skip packing
    m = found.match
    best: tuple[int, int, V] | None = None  # (reuse, trim, value)

    def offer(reuse: int, trim: int, value: V) -> None:
        nonlocal best
        if reuse > 0 and (best is None or (reuse, -trim) > (best[0], -best[1])):
            best = (reuse, trim, value)

    for anc in m.ancestors:
        n = anc.length
        if not trimmable(anc.value) and n <= limit and align(n) == n:
            offer(n, 0, anc.value)
    near = found.nearest
    if near is not None:
        cap = min(near.common, limit)
        reuse = align(cap) if cap > 0 else 0
        assert 0 <= reuse <= cap, f"align({cap}) = {reuse}"
        offer(reuse, near.length - reuse, near.value)
    if best is None:
        return Reuse(None, 0, 0, m.matched)
    return Reuse(best[2], best[0], best[1], m.matched)
