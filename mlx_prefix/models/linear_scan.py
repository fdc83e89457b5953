"""Gated-delta layers (Qwen3.5, Qwen3-Next) prefill as a chunked scan off Metal.

mlx-lm computes the gated delta rule of a hybrid model's linear-attention layers with a
fused kernel on Metal and, on every other device (the CPU, CUDA), as a loop of one
step per token: a 256-token prefill chunk is 256 small dependent updates per layer.
mlx-vlm's `gated_delta_chunked` computes the same recurrence as a chunked parallel scan
(matmuls inside blocks of 64 tokens, then one state update per block). Measured on the
2-core AMD EPYC (mlx[cpu] 0.32.4, OpenBLAS), one 256-token chunk of Qwen3.5-4B's linear
layer shapes (16 key / 32 value heads of 128): 297 ms by the loop, 45 ms chunked, the
outputs within 7e-7.

Why the cache stays exact: a grid chunk's result depends on its tokens, its length and
the state it starts from, whichever of the two computes it, and a hit and a miss run
the same chunks from the same states (invariant 4). The loop keeps what it does best:
decode steps and short forwards (a speculative verify, a chunk under `MIN_TOKENS`),
vectorized gating, and the variants with bounds (Kimi's). Nothing changes on Metal.
`install` swaps the function where mlx-lm's model modules imported it; without mlx-vlm
(a text-only install) they keep the loop. A model that computes by the scan says so in
its identity (`uses_scan`), so states the loop computed (a disk file from before, or
from an install without mlx-vlm) are never restored into it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

log = logging.getLogger("mlx_prefix.engine")

MIN_TOKENS = 64  # the scan's block: shorter forwards gain nothing from it
_chunked: Callable | None = None  # the swapped-in update, made once


def install() -> bool:
    """Swap mlx-lm's gated delta update for the chunked prefill in every loaded mlx-lm
    model module that imported it (call after a model's load: its module is loaded
    then). True when the scan is in use."""
    global _chunked
    if mx.metal.is_available():
        return False  # mlx-lm's fused Metal kernel
    try:
        from mlx_lm.models import gated_delta
        from mlx_vlm.models.qwen3_5.gated_delta import gated_delta_chunked
    except ImportError:
        log.debug("mlx-vlm not installed: gated-delta prefill stays mlx-lm's loop")
        return False
    loop = gated_delta.gated_delta_update  # never replaced in its own module
    if _chunked is None:
        _chunked = _chunked_prefill(loop, gated_delta.compute_g, gated_delta_chunked)
    for name, module in list(sys.modules.items()):
        imported = getattr(module, "gated_delta_update", None) is loop
        if name.startswith("mlx_lm.models.") and module is not gated_delta and imported:
            setattr(module, "gated_delta_update", _chunked)  # noqa: B010
    return True


def uses_scan(model: Any) -> bool:
    """Whether `model`'s layers compute the gated delta rule by the chunked scan."""
    names = {type(m).__module__ for m in model.modules()}
    return any(getattr(getattr(sys.modules.get(n), "gated_delta_update", None), "chunked", False)
               for n in names)  # fmt: skip


def _chunked_prefill(loop: Callable, compute_g: Callable, scan: Callable) -> Callable:
    def gated_delta_update(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        a: mx.array,
        b: mx.array,
        A_log: mx.array,
        dt_bias: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
        **options: Any,
    ) -> tuple[mx.array, mx.array]:
        bounded = options.get("lower_bound") is not None or options.get("allow_neg_eigval")
        if q.shape[1] < MIN_TOKENS or bounded:
            return loop(q, k, v, a, b, A_log, dt_bias, state, mask, **options)
        g = compute_g(A_log, a, dt_bias)
        if g.ndim != 3:  # vectorized gating: the scan takes one gate per head
            return loop(q, k, v, a, b, A_log, dt_bias, state, mask, **options)
        if state is None:
            state = mx.zeros((q.shape[0], v.shape[-2], v.shape[-1], q.shape[-1]), mx.float32)
        y, new_state = scan(q, k, v, g, mx.sigmoid(b), state, mask)
        return y, new_state.astype(state.dtype)

    gated_delta_update.chunked = True  # type: ignore[attr-defined]
    return gated_delta_update
