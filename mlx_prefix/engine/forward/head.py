"""The output head on a prompt's last position only.

A prompt's last grid chunk needs the logits of its last position alone, yet a model
called on [B, L] tokens applies its output head (the LM head, or the tied embedding
read as a linear layer) to all L positions: on SmolLM2 (49,152 tokens, width 576) that
is 10% of a 55-token chunk's time and 17% of a 256-token one's on a CPU, more where the
vocabulary is large for the width (Qwen's 151,936 on a 1,024-wide model). mlx_lm avoids
it by computing a prompt's last token in a forward of its own; here the chunks are the
canonical grid's (invariant 4), so instead the head itself takes only the last position
inside `last_position_head`. What the cache stores does not change (the head feeds no
layer), and a hit's logits come from the same call as a miss's.

`install` finds the heads by what mlx-lm names them: modules called `lm_head`, and
every embedding's `as_linear` (the tied head). A model whose head is named otherwise
keeps computing every position, which is only slower. Engine thread only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

_mode = threading.local()


@contextmanager
def last_position_head() -> Iterator[None]:
    """Forwards built in this thread inside the block apply the output head to each
    row's last position only: logits [B, 1, V]."""
    before = getattr(_mode, "last", False)
    _mode.last = True
    try:
        yield
    finally:
        _mode.last = before


def _last(x: mx.array) -> mx.array:
    """Hidden states [..., L, D] -> [..., 1, D] inside `last_position_head`."""
    return x[..., -1:, :] if getattr(_mode, "last", False) and x.ndim >= 2 else x


class LastPositionHead(nn.Module):
    """An `lm_head` that, inside `last_position_head`, projects the last position only.
    The projection stays a child (`head`), so --deterministic's batch-invariant layers
    (rowwise.install) still reach it."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def __call__(self, x: mx.array) -> mx.array:
        return self.head(_last(x))


def install(model: nn.Module) -> int:
    """Make the model's output heads obey `last_position_head` (idempotent); returns how
    many were found."""
    found = 0
    for _, module in model.named_modules():
        head = module.get("lm_head") if isinstance(module, nn.Module) else None
        if isinstance(head, nn.Module) and not isinstance(head, LastPositionHead):
            module["lm_head"] = LastPositionHead(head)
            found += 1
        elif isinstance(head, LastPositionHead):
            found += 1
        if hasattr(module, "as_linear"):
            if "as_linear" not in vars(module):
                # Looked up on the class at each call: rowwise.install may swap it later.
                module.as_linear = _tied(module)
            found += 1
    return found


def _tied(embedding: nn.Module):
    def as_linear(x: mx.array) -> mx.array:
        # Its class at call time: --deterministic may have made it a batch-invariant one.
        cls: Any = type(embedding)
        return cls.as_linear(embedding, _last(x))

    return as_linear
