"""Recurrent scans of a verify forward computed one position at a time, as the decode
steps at those positions compute them (engine/decode/speculative.py).

mlx-lm's Mamba-2 layers (nemotron_h, mamba2, falcon_h1, granitemoehybrid, plamo2) call
`ssm_update`, which takes another path for several positions than for one: the SSD
form, a masked "attention" over the chunk, whose sums round differently from the
recurrence a decode step runs (measured on the nemotron_h test model: a verify of 4
positions differed from 4 decode steps; of 2, not). Inside a verify forward
(rowwise.py's `batched(..., verify=True)`) the scan runs position by position, each
call the one a decode step makes, so the state after each position, and each row's
output, are plain decoding's. The projections around it stay one call of all rows.
Mamba-1's mixers (mamba, jamba), Griffin's RG-LRU block (recurrent_gemma) and RWKV-7's
layers take no mask (and recurrent_gemma's several-position form rounds otherwise too):
inside a verify, or a padded one of several rows, the whole mixer runs one decode step
per position, and a row's state past its length is selected back. Outside a verify, and
for a prefill, nothing changes.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

_PATCHED = "_stepwise_in_verify"
_forced = threading.local()


@contextmanager
def positionwise() -> Iterator[None]:
    """Scans built in this thread inside the block step position by position outside a
    verify too: a padded verify of several rows (engine/decode/verify_rows.py), whose
    masked pads the multi-position form would let into the state (its SSD form keeps
    the last position's decay, a pad's)."""
    before = getattr(_forced, "on", False)
    _forced.on = True
    try:
        yield
    finally:
        _forced.on = before


def _stepwise_ssm(base, in_verify: Callable[[], bool]):
    signature = inspect.signature(base)

    def ssm_update(*args: Any, **kwargs: Any):
        if not (in_verify() or getattr(_forced, "on", False)):
            return base(*args, **kwargs)
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        a = given.arguments  # hidden_states [B, L, H, D], B, C [B, L, G, N], dt [B, L, H]
        steps = a["hidden_states"].shape[1]
        if steps == 1 or a["state"] is None:
            return base(*args, **kwargs)
        ys, state, mask = [], a["state"], a["mask"]
        lengths, a["lengths"] = a["lengths"], None
        if lengths is not None and mask is None:
            mask = mx.arange(steps) < lengths[:, None]
        # Rows padded to the longest (mamba2, falcon_h1, granitemoehybrid pass `lengths`
        # beside the mask that holds them): a masked position leaves the state as it
        # was (its decay exp(0) = 1, its input's weight 0), so stepping with the mask
        # alone stops each row's state at its own length.
        for t in range(steps):
            one = {k: a[k][:, t : t + 1] for k in ("hidden_states", "B", "C", "dt")}
            one["mask"] = None if mask is None else mask[..., t : t + 1]
            y, state = base(**(a | one | {"state": state}))
            ys.append(y)
        return mx.concatenate(ys, axis=1), state

    setattr(ssm_update, _PATCHED, True)
    return ssm_update


# mlx-lm mixers that take no mask (Mamba-1's selective scan: mamba, jamba; Griffin's
# RG-LRU: recurrent_gemma; RWKV-7's layer, its time and channel mixing sharing a cache):
# a padded row's pads would run into their conv and state.
_UNMASKED = {
    "mlx_lm.models.mamba": "MambaBlock",
    "mlx_lm.models.jamba": "JambaMambaMixer",
    "mlx_lm.models.recurrent_gemma": "RecurrentBlock",
    "mlx_lm.models.rwkv7": "Rwkv7Layer",
}
_mixers: dict[type, type] = {}


def _at(value: Any, t: int, x: mx.array) -> Any:
    """An argument given per position like `x` [B, L, ...], at position t."""
    if isinstance(value, mx.array) and value.shape[:2] == x.shape[:2]:
        return value[:, t : t + 1]
    return value


def _stepwise_mixer(cls: type, in_verify: Callable[[], bool]) -> type:
    """`cls` whose call in a verify, or on rows padded to the longest (`positionwise`,
    ArraysCache's `lengths` set), is one decode step of the mixer per position; a padded
    row's conv and SSM state kept as it was (selected, not computed) past its length."""
    if cls not in _mixers:
        base = cls.__call__

        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
            # Stepped at one position too: a row of length 0 (settled already) keeps its state.
            given = (*args, *kwargs.values())
            cache = next((a for a in given if isinstance(a, ArraysCache)), None)
            lengths: mx.array | None = getattr(cache, "lengths", None)
            if not getattr(_forced, "on", False):
                lengths = None  # set by mlx-lm's own batching, not a padded verify's
            if cache is None or (lengths is None and not (in_verify() and x.shape[1] > 1)):
                return base(self, x, *args, **kwargs)
            ys = []
            for t in range(x.shape[1]):
                before = list(cache.cache)
                # Arguments by position (RWKV-7's first value) at t; a mask goes unused.
                at = [_at(a, t, x) for a in args]
                ys.append(base(self, x[:, t : t + 1], *at, **kwargs))
                if lengths is None:
                    continue
                live = lengths > t
                for i, (old, new) in enumerate(zip(before, cache.cache, strict=True)):
                    if new is not None:
                        old = mx.zeros_like(new) if old is None else old  # a fresh state's
                        cache[i] = mx.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
            if isinstance(ys[0], tuple):  # RWKV-7: (out, the first layer's values)
                return tuple(mx.concatenate(list(y), axis=1) for y in zip(*ys, strict=True))
            return mx.concatenate(ys, axis=1)

        _mixers[cls] = type(f"Stepwise{cls.__name__}", (cls,), {"__call__": __call__})
    return _mixers[cls]


def install(model: nn.Module, in_verify: Callable[[], bool]) -> None:
    """Make the model's Mamba-2 scans, and its Mamba-1, RG-LRU and RWKV-7 mixers
    (`_UNMASKED`), step through a verify position by position (idempotent; every mlx-lm
    module its layers come from that calls `ssm_update`); `in_verify`: whether the
    forward being built is a verify (rowwise.py says)."""
    for _, module in model.named_modules():
        cls = type(module)
        if _UNMASKED.get(cls.__module__) == cls.__name__:
            module.__class__ = _stepwise_mixer(cls, in_verify)
        source: Any = sys.modules.get(type(module).__module__)
        ssm = getattr(source, "ssm_update", None)
        if ssm is not None and not getattr(ssm, _PATCHED, False):
            source.ssm_update = _stepwise_ssm(ssm, in_verify)
