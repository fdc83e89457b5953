"""The payload of a checkpoint file: the layer tree and the tensor data (MLX).

The header (`header.py`) holds the file's identity and digests; this module lays a
Snapshot out as a header plus tensor data, and reads it back. The header's `layers`
field is JSON, one object per model layer:
  LAYER: {"cls": "module:QualName", "state": TREE, "children": [LAYER, ...]}
  TREE:  {"@": tensor name} | {"tuple": [TREE...]} | [TREE...] |
         {"dict": {str: TREE}} | null | bool | int | float | str

`load` reads a file once, start to end: header verified, then each tensor read into
one buffer that is hashed and turned into an MLX array (peak memory: the arrays plus
one tensor's bytes).
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from mlx_prefix.cache.disk import header as hdr
from mlx_prefix.cache.disk import trust
from mlx_prefix.cache.disk.header import DiskFormatError, FileHeader, TensorInfo
from mlx_prefix.cache.snapshot import LayerSnapshot, Snapshot, from_whole, whole_layers

_ALLOWED_MODULE_PREFIX = "mlx_lm.models."  # cache classes are only resolved from here

_DTYPES: dict[Any, str] = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}
_FROM_NAME: dict[str, tuple[Any, int]] = {
    name: (dtype, dtype.size) for dtype, name in _DTYPES.items()
}  # safetensors name -> (MLX dtype, item size)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # arrays are built as these

assert {n: s for n, (_, s) in _FROM_NAME.items()} == hdr.DTYPE_SIZES, "dtype tables differ"


@dataclass(frozen=True, slots=True)
class Encoded:
    """A checkpoint ready to be written: header bytes plus the arrays in data order."""

    header: bytes  # 8-byte length prefix + JSON, both digests still placeholders
    arrays: tuple[mx.array, ...]
    size: int  # the file's total size


# -- writing --------------------------------------------------------------------


def encode(
    snapshot: Snapshot, model_key: str, tokens: Sequence[int], kind: str, runtime: str
) -> Encoded:
    """Lay out `snapshot` as a file. Does not mutate; reads no array data.

    Raises ValueError for a state holding something other than arrays, scalars,
    strings, None and (nested) tuples/lists/dicts of them.
    """
    arrays: list[mx.array] = []
    # Whole: a file stands alone (its chain's pieces concatenated, evaluated one at a
    # time as they are written), so the disk tier holds about one copy of each token.
    layers = [_encode_layer(layer, arrays) for layer in whole_layers(snapshot)]
    tensors: list[TensorInfo] = []
    offset = 0
    for a in arrays:
        if a.dtype not in _DTYPES:
            raise ValueError(f"cannot store arrays of dtype {a.dtype}")
        tensors.append(TensorInfo(_DTYPES[a.dtype], tuple(a.shape), offset, offset + a.nbytes))
        offset += a.nbytes
    header = hdr.build(model_key, tokens, kind, runtime, snapshot.trimmable, layers, tensors)
    return Encoded(header, tuple(arrays), len(header) + offset)


def write(f: BinaryIO, enc: Encoded) -> None:
    """Write `enc` to the binary file `f` (positioned at 0), then its header again with
    both digests filled in."""
    f.write(enc.header)
    h = hashlib.sha256()
    for a in enc.arrays:
        write_array(f, a, h)
    f.seek(0)
    f.write(hdr.seal(enc.header, h.hexdigest()))
    f.seek(0, 2)


def write_array(f: BinaryIO, a: mx.array, h: Any) -> None:
    """Append one array's bytes (row-major) to `f` and to the hash `h`."""
    raw = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)  # a C-contiguous copy
    data = raw.data.cast("B") if raw.size else b""
    h.update(data)
    f.write(data)


def _encode_layer(layer: LayerSnapshot, arrays: list[mx.array]) -> dict[str, Any]:
    return {
        "cls": f"{layer.cls.__module__}:{layer.cls.__qualname__}",
        "state": _encode_tree(layer.state, arrays),
        "children": [_encode_layer(c, arrays) for c in layer.children],
    }


def _encode_tree(x: Any, arrays: list[mx.array]) -> Any:
    if isinstance(x, mx.array):
        arrays.append(x)
        return {"@": f"t{len(arrays) - 1}"}
    if isinstance(x, tuple):
        return {"tuple": [_encode_tree(v, arrays) for v in x]}
    if isinstance(x, list):
        return [_encode_tree(v, arrays) for v in x]
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"dict": {k: _encode_tree(v, arrays) for k, v in x.items()}}
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float) and math.isfinite(x):
        return x
    raise ValueError(f"cache state holds an unstorable {type(x).__name__}")


# -- reading --------------------------------------------------------------------


def load(path: Path, model_key: str, tokens: tuple[int, ...], runtime: str) -> Snapshot:
    """Read the checkpoint of (`model_key`, `tokens`) written by `runtime`, verified.

    Reads the file once: the header is verified and compared with the expected identity
    before any tensor data is read; each tensor's bytes are hashed and become an MLX
    array (evaluated). Raises DiskFormatError for a damaged, stale or different file,
    ForeignRuntime for another runtime's valid file, Untrusted for a file another user
    could have written, OSError if it cannot be read.
    Does not mutate anything on disk.
    """
    with open(path, "rb") as f:
        why = trust.untrusted(os.fstat(f.fileno()))
        if why is not None:  # replaced since the scan
            raise trust.Untrusted(f"it is {why}")
        header = hdr.read_from(f)
        if header.model_key != model_key or header.tokens != tokens:
            raise DiskFormatError("model key or token ids differ from the index")
        if header.runtime != runtime:
            raise hdr.ForeignRuntime(f"written by {header.runtime}")
        h = hashlib.sha256()
        arrays: dict[str, mx.array] = {}
        f.seek(header.data_start)
        for name, t in header.tensors.items():  # data order: one sequential read
            raw = np.empty(t.end - t.begin, dtype=np.uint8)
            _read_exact(f, raw.data)
            h.update(raw.data)
            mx_dtype, width = _FROM_NAME[t.dtype]
            a = mx.array(raw.view(_UINT[width]).reshape(t.shape))  # copies
            arrays[name] = a if a.dtype == mx_dtype else a.view(mx_dtype)
    if h.hexdigest() != header.data_digest:
        raise DiskFormatError("tensor data does not match its digest")
    snapshot = decode(header, arrays)
    mx.eval(list(arrays.values()))
    return snapshot


def _read_exact(f: BinaryIO, view: memoryview) -> None:
    while view:
        n = f.readinto(view)  # type: ignore[attr-defined]
        if not n:
            raise DiskFormatError("truncated while reading tensor data")
        view = view[n:]


def decode(header: FileHeader, arrays: dict[str, mx.array]) -> Snapshot:
    """Rebuild the Snapshot from a header and its loaded tensors, its KV as a chain of
    one piece (the loaded arrays: requests restored from it chain onto them). Does not
    mutate."""
    if set(arrays) != set(header.tensors):
        raise DiskFormatError("tensors differ from the header")
    layers = tuple(_decode_layer(x, arrays) for x in header.layers)
    whole = Snapshot(
        length=len(header.tokens),
        trimmable=header.trimmable,
        nbytes=sum(a.nbytes for a in arrays.values()),
        layers=layers,
    )
    return from_whole(whole)


def _decode_layer(x: dict[str, Any], arrays: dict[str, mx.array]) -> LayerSnapshot:
    state = _decode_tree(x["state"], arrays)
    if not isinstance(state, tuple):
        raise DiskFormatError("a layer state must be a tuple")
    children = tuple(_decode_layer(c, arrays) for c in x["children"])
    return LayerSnapshot(resolve_class(x["cls"]), state, children)


def _decode_tree(x: Any, arrays: dict[str, mx.array]) -> Any:
    if isinstance(x, dict):
        if "@" in x:
            return arrays[x["@"]]
        if "tuple" in x:
            return tuple(_decode_tree(v, arrays) for v in x["tuple"])
        if "dict" in x:
            return {k: _decode_tree(v, arrays) for k, v in x["dict"].items()}
        raise DiskFormatError(f"unknown state node {sorted(x)}")
    if isinstance(x, list):
        return [_decode_tree(v, arrays) for v in x]
    return x


def resolve_class(spec: str) -> type:
    """The cache class named "module:QualName"; only mlx-lm's model modules are imported."""
    module, _, qualname = spec.partition(":")
    if not module.startswith(_ALLOWED_MODULE_PREFIX) or not qualname:
        raise DiskFormatError(f"cache class {spec!r} is not an mlx-lm class")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise DiskFormatError(f"{spec!r} is not a class")
    return obj
