"""An entry handed to the request that extends it, and its longer entry handed back (MLX).

Under a tight budget a conversation's next turn cannot hold its stored entry beside the
live copy its cache makes of it (issue 55: at 190 MiB an 88 MiB conversation missed
every turn: the copy evicted the entry, then the longer entry was refused). So the
store hands the entry over (`PromptCache.hand_over`): the request's cache becomes the
only copy of those tokens, and the entry's pieces are freed as soon as the restore has
copied them (`settle`). The end of its prompt (of any request's, when the budget cannot
hold the piece beside the live cache: a conversation's first turn) is not cut into a
piece of its own at the end of prefill (a second copy while the cache decodes on), and
no other checkpoint is cut that the budget cannot hold beside it; when it finishes,
its decode row's first positions become the entry (`row_snapshot`): a lone row's
buffer is kept as it is (views, no copy: the batch lets go of it), a row among others
is copied out, as a checkpoint's piece is. Either way the KV is what the prefill wrote
(decode appends after it), so a hit on it is exact.

Only plain attention KV (mlx-lm's KVCache in every layer) goes this way: recurrent or
rotating state is captured at its own boundary and is small beside the KV.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_prefix.cache.chain import Chain, Piece
from mlx_prefix.cache.layers.base import unstash
from mlx_prefix.cache.snapshot import Snapshot, capture
from mlx_prefix.cache.types import Buffer, new_buffer_key


def plain_kv(snapshot: Any) -> bool:
    """Whether `snapshot` holds only KVCache layers, all in its chain (no draft)."""
    if not isinstance(snapshot, Snapshot) or snapshot.draft is not None:
        return False
    if not snapshot.trimmable or not snapshot.chain.pieces:
        return False
    return all(x.cls is KVCache and not x.children and x.slot >= 0 for x in snapshot.layers)


def plain_kv_cache(cache: list[Any]) -> bool:
    """Whether a live cache is KVCache layers only (what `row_snapshot` reads back)."""
    return bool(cache) and all(type(c) is KVCache for c in cache)


def kv_bytes(cache: list[Any], tokens: int) -> int:
    """Bytes `tokens` positions of a plain-KV live cache take (keys and values, every
    layer): what a piece of that many positions would copy."""
    total = 0
    for c in cache:
        if c.keys is not None and c.keys.shape[2]:
            total += (c.keys.nbytes + c.values.nbytes) * tokens // c.keys.shape[2]
    return total


def settle(cache: list[Any]) -> None:
    """A cache restored from a handed-over entry: evaluate its copy of the pieces now and
    forget them (a merge would read them instead), so they are freed at once."""
    mx.eval([a for c in cache for a in (c.keys, c.values) if a is not None])
    for c in cache:
        unstash(c)


def row_snapshot(batch: list[Any], row: int, length: int, lone: bool) -> Snapshot:
    """The first `length` positions of decode row `row` of a batch cache (mlx-lm's
    BatchKVCache per layer), as a snapshot of plain KV layers. `lone`: the row is the
    batch's only one and the batch lets go of its buffers: the snapshot views them (no
    copy; it keeps them alive whole, counted so). Otherwise the positions are copied."""
    live: list[Any] = []
    for layer in batch:
        pad = int(layer.left_padding[row].item())
        c = KVCache()
        c.keys = layer.keys[row : row + 1, :, pad : pad + length, :]
        c.values = layer.values[row : row + 1, :, pad : pad + length, :]
        c.offset = length
        live.append(c)
    if not lone:
        return capture(live, length)  # a piece cut from the row: a copy
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in batch)
    return _viewed(live, length, held)


def live_snapshot(cache: list[Any], length: int) -> Snapshot:
    """The first `length` positions of a plain-KV live cache its request lets go of (a
    cancelled one's, whose end was left to a decode row it never reached), as views: no
    copy; the snapshot keeps its buffers alive whole, counted so."""
    live: list[Any] = []
    for layer in cache:
        c = KVCache()
        c.keys = layer.keys[..., :length, :]
        c.values = layer.values[..., :length, :]
        c.offset = length
        live.append(c)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache)
    return _viewed(live, length, held)


def _viewed(live: list[Any], length: int, held: int) -> Snapshot:
    """A snapshot of `live`'s views as one piece keeping `held` bytes alive."""
    parts = tuple((c.keys, c.values) for c in live)
    mx.eval([a for p in parts for a in p])
    piece = Piece(0, length, parts, tuple(KVCache for _ in live), Buffer(new_buffer_key(), held))
    return capture(live, length, Chain((piece,)))
