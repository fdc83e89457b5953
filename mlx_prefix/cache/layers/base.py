"""What the engine needs from one mlx-lm cache class, with the defaults most share.

A model's cache is a list of per-layer cache objects (mlx-lm's `make_prompt_cache`),
each of some class: KV, quantized KV, chunked, rotating (sliding window), arrays
(recurrent / SSM state), or a CacheList of several. Each class has one `LayerKind`
(one module in this package) that says how to capture and restore it (cache/snapshot.py),
whether it may be trimmed, how running requests' layers merge into a decode batch
(engine/decode/batch.py), whether --kv-bits quantizes it (engine/forward/kv_quant.py),
and which part of a prefill's work it is (models/cost.py). A model family with a new
cache class is one new module here, registered in `__init__.KINDS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

# The part of a prefill's work a layer does (models/cost.py): attention over every
# earlier token, over a window of them, or a recurrent state update per token.
CostRole = Literal["full", "window", "recurrent"]


@dataclass(frozen=True, slots=True)
class LayerSnapshot:
    cls: type[Any]  # the cache class to rebuild (through its `from_state`)
    # Its `state`, arrays as the snapshot's own objects, KV sliced to offset; for a layer
    # in the snapshot's chain (`slot` >= 0), only what its kind's `join` needs besides the
    # KV (cache/chain.py).
    state: tuple[Any, ...]
    children: tuple[LayerSnapshot, ...] = ()  # CacheList members (then `state` is empty)
    slot: int = -1  # >= 0: its KV is the snapshot chain's parts[slot]


# A restored layer's parts (cache/chain.py), for a merge before its first append.
_STASH = "_mlx_prefix_parts"


def stash(c: Any, parts: Sequence[tuple[Any, ...]]) -> None:
    """Remember on restored layer `c` the parts its (lazy) arrays concatenate."""
    setattr(c, _STASH, (tuple(parts), c.offset, c.keys))


def stashed(c: Any) -> list[tuple[Any, ...]] | None:
    """The parts of a restored layer nothing has written into since (its offset and
    arrays as restored; a write moves the offset), else None."""
    found = getattr(c, _STASH, None)
    if found is None:
        return None
    parts, offset, keys = found
    return list(parts) if c.offset == offset and c.keys is keys else None


def unstash(c: Any) -> None:
    """Forget `c`'s parts (they would keep the pieces alive as long as `c`)."""
    if hasattr(c, _STASH):
        delattr(c, _STASH)


def view(a: Any) -> Any:
    """A fresh array object over the same buffer (or `a` if not an array)."""
    return a[...] if isinstance(a, mx.array) else a


def head(x: Any, n: int) -> Any:
    """The first `n` positions of a [B, H, T, D] buffer, as a view."""
    return x[..., :n, :]


def check_offset(c: Any, length: int) -> None:
    if c.offset != length:
        raise ValueError(f"{type(c).__name__} offset {c.offset} != checkpoint length {length}")


NO_STACKING, EQUAL_TAILS, PADDED_TAILS = 0, 1, 2


class LayerKind:
    """A cache class the engine can serve. The defaults fit a class whose state is
    replaced as a whole (never written in place) and that mlx-lm can merge."""

    classes: tuple[type, ...] = ()
    # Positions below the offset never change once written (checkpoints of one prefill
    # may bind such layers late and share their buffer: cache/snapshot.py).
    append_only = False
    # Any earlier position can be restored by trimming, whatever happened since: one
    # snapshot at a prompt's end serves every shorter prefix.
    always_trimmable = False
    # Restores only at exactly the captured length, even if mlx-lm could trim it.
    exact_only = False
    quantized = False  # holds --kv-bits quantized KV
    cost_role: CostRole = "full"
    # Its KV goes into a snapshot's chain of pieces, each token's once (cache/chain.py):
    # append-only KV, whose positions below the offset never change once written.
    chained = False

    def capture(self, c: Any, length: int) -> LayerSnapshot:
        """The layer after `length` tokens, as views of its buffers. Does not mutate."""
        return LayerSnapshot(type(c), tuple(tree_map(view, c.state)))

    def restore(self, layer: LayerSnapshot, trim: int) -> Any:
        """A fresh layer sharing the snapshot's buffers, `trim` tokens shorter."""
        obj = layer.cls.from_state(tree_map(view, layer.state))
        if trim:
            obj.trim(trim)
        return obj

    # -- a `chained` kind's KV as pieces (cache/chain.py; layers/kv.py implements them) --
    def split(self, state: tuple[Any, ...]) -> tuple[tuple[mx.array, ...], tuple[Any, ...]]:
        """A state as (its KV arrays, positions on axis -2; the rest `join` needs)."""
        raise NotImplementedError(f"{type(self).__name__} is not chained")

    def join(self, arrays: tuple[mx.array, ...], n: int, rest: tuple[Any, ...]) -> tuple:
        """The state holding `n` positions of `arrays` (which may be longer: room)."""
        raise NotImplementedError(f"{type(self).__name__} is not chained")

    def holds(self, state: tuple[Any, ...], n: int) -> bool:
        """Whether `state` (read from a file) is this kind's whole state of `n` positions."""
        return False

    def cut(self, c: Any, start: int, end: int) -> tuple[mx.array, ...]:
        """Live layer `c`'s positions [start, end), copied into arrays of their own."""
        raise NotImplementedError(f"{type(self).__name__} is not chained")

    def room(self, cls: type, length: int, extend: int) -> int:
        """Positions a restored layer of `length` positions leaves past its offset for a
        first append of `extend` tokens (0: none)."""
        return 0

    def batchable(self, c: Any) -> bool:
        """Whether this layer may decode in a batch with others (mlx-lm can merge it)."""
        return hasattr(c, "merge")

    def merge(self, layers: Sequence[Any], steps: int) -> Any:
        """Several sequences' layers as one batch cache, with room for `steps` more
        tokens where that saves a copy."""
        return type(layers[0]).merge(list(layers))

    def tail_stacking(self, c: Any) -> int:
        """How several prompts' tails may prefill in one forward through this layer
        (engine/prefill/tails.py): NO_STACKING, EQUAL_TAILS (tails of one length: the
        batch cache only left-pads the histories) or PADDED_TAILS (right-padded tails
        of any lengths: the batch cache masks and moves the padding, mlx-lm's
        `prepare`/`finalize`)."""
        return NO_STACKING

    def quantizes(self, c: Any, start: int) -> bool:
        """Whether --kv-bits turns this layer into quantized KV now (mlx_lm's rule)."""
        return False

    def arrays(self, c: Any) -> list[Any]:
        """The live layer's state, flattened (for evaluation and byte counts)."""
        return arrays_in(c.state)

    def keeping(self, c: Any, n: int) -> tuple[Any, ...]:
        """The state of `c` keeping its first `n` tokens, as fresh views: only an
        append-only kind can (a deferred capture, cache/snapshot.py)."""
        raise NotImplementedError(f"{type(c).__name__} keeps no prefix of its state")


def arrays_in(tree: Any) -> list[mx.array]:
    """The MLX arrays of a nested state (mlx.utils.tree_flatten's leaves)."""
    leaves = cast("list[tuple[str, Any]]", tree_flatten(tree))  # a list without `destination`
    return [a for _, a in leaves if isinstance(a, mx.array)]
