"""Typed forms of mlx calls whose stubs answer a union over their arguments.

`tree_flatten` returns a list of (name, leaf) pairs, or a dict when given
`destination`; `mx.load` returns one array (.npy), a dict of arrays (.safetensors,
.npz), or a tuple with the metadata when asked for it. Each helper narrows to the one
shape its call returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


def named_arrays(tree: Any) -> list[tuple[str, mx.array]]:
    """A module's `parameters()` (a tree of arrays) as (dotted name, array) pairs."""
    flat = tree_flatten(tree)
    assert isinstance(flat, list)  # a list without `destination`
    return flat


def load_safetensors(path: str | Path) -> dict[str, mx.array]:
    """A safetensors file's arrays by name."""
    loaded = mx.load(str(path))
    assert isinstance(loaded, dict)
    return loaded


def load_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """A GGUF file's tensors by name and its metadata."""
    loaded = mx.load(str(path), return_metadata=True)
    assert isinstance(loaded, tuple)
    return loaded


def drop_parameters(module: Any) -> None:
    """Replace every parameter of an mlx Module in place with one empty array (an
    unload): every holder of the module lets go of the weights at once."""
    from mlx.utils import tree_map

    empty = mx.zeros((0,))
    mx.eval(empty)
    module.update(tree_map(lambda _: empty, module.parameters()))
