"""Pins: the stored sequences eviction never takes (nor drops as redundant), and the
share of the budget one client may pin.

A pin is kept by (model key, tokens), so it also covers an entry stored later; each
stored entry's `pinned` flag is kept in step with the pins (the flag, not a lookup
here, is what eviction and listings read: hashing a long token tuple per entry held
the store's lock for ~50 ms at 500 entries of 5K tokens). One namespace's pinned
entries (its distinct buffers, over every model) stay within `share` of the budget: a
pin past it is refused (PinQuotaExceeded), changing nothing, so one client cannot pin
the budget full and leave no room for anyone else's inserts.

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

from mlx_prefix.cache.entries import Entry
from mlx_prefix.errors import PinQuotaExceeded

PinKey = tuple[str, Hashable]  # (model key, token ids)


class Pins:
    def __init__(self, share: float, entries: Mapping[int, Entry]) -> None:
        self.share = share  # of the budget, what one namespace may pin
        self._keys: set[PinKey] = set()
        self._entries = entries  # the store's, read only

    def __contains__(self, key: PinKey) -> bool:
        return key in self._keys

    def pin(self, model_key: str, tokens: tuple[int, ...], e: Entry | None, budget: int) -> None:
        """Pin `tokens` and their stored entry `e` (if any); PinQuotaExceeded first if
        `e` would take its namespace past its share."""
        if e is not None:
            self.pin_entries([e], budget)
        self._keys.add((model_key, tokens))

    def pin_entries(self, entries: Sequence[Entry], budget: int) -> None:
        """Pin stored entries of one namespace, all or none (PinQuotaExceeded)."""
        self._refuse_over_share(entries, budget)
        for e in entries:
            e.pinned = True
            self._keys.add((e.model_key, e.tokens))

    def unpin(self, model_key: str, tokens: tuple[int, ...], e: Entry | None) -> bool:
        """Remove the pin of `tokens` (and `e`'s flag, their stored entry if any).
        Returns whether it was pinned."""
        try:
            self._keys.remove((model_key, tokens))
        except KeyError:
            return False
        if e is not None:
            e.pinned = False
        return True

    def set(self, e: Entry, pinned: bool, budget: int) -> None:
        """Pin or unpin stored entry `e` (a pin may raise PinQuotaExceeded)."""
        if pinned:
            self.pin_entries([e], budget)
        else:
            e.pinned = False
            self._keys.discard((e.model_key, e.tokens))

    def adopt(self, e: Entry, budget: int) -> None:
        """A new entry `e`: pinned if a pin came before it, unless that would take its
        namespace past its share (then the pin is dropped)."""
        if (e.model_key, e.tokens) in self._keys:
            if self._overflow([e], budget) is None:
                e.pinned = True
            else:
                self._keys.discard((e.model_key, e.tokens))

    def clear(self, chosen: Callable[[str], bool]) -> None:
        """Drop the pins of the model keys `chosen` selects, and their entries' flags."""
        self._keys = {p for p in self._keys if not chosen(p[0])}
        for e in self._entries.values():
            e.pinned = e.pinned and not chosen(e.model_key)

    def _overflow(self, adding: Sequence[Entry], budget: int) -> tuple[int, int] | None:
        """(bytes its namespace would have pinned, its share) if pinning `adding` (one
        namespace's entries) would go past the share; None if it fits."""
        if not adding:
            return None
        owner = namespace(adding[0].model_key)
        held: dict[int, int] = {}
        for e in self._entries.values():
            if e.pinned and namespace(e.model_key) == owner:
                held.update((b.key, b.nbytes) for b in e.buffers)
        for e in adding:
            held.update((b.key, b.nbytes) for b in e.buffers)
        total, share = sum(held.values()), int(self.share * budget)
        return (total, share) if total > share else None

    def _refuse_over_share(self, adding: Sequence[Entry], budget: int) -> None:
        over = self._overflow(adding, budget)
        if over is not None:
            raise PinQuotaExceeded(
                f"pinning this would hold {over[0]} bytes pinned for this client, more than "
                f"its share of the cache ({over[1]} bytes: --pin-share {self.share:g} of "
                f"the {budget}-byte budget); unpin entries first"
            )


def namespace(key: str) -> str:
    """Whose pins an entry's are: the namespace part of its key (engine/keys.py:
    `<model>/<namespace>[/<salt>]`), the same for every model; a key without one is its
    own owner."""
    parts = key.split("/")
    return parts[1] if len(parts) > 1 else key
