"""The on-disk form of one checkpoint: a standard safetensors file (DESIGN 8).

Layout (safetensors; `mx.load` reads it back):
  [0, 8)       N: header length, little-endian u64
  [8, 8+N)     JSON header, space-padded to a multiple of 8:
               {"__metadata__": {str: str}, "<tensor>": {dtype, shape, data_offsets}, ...}
  [8+N, end)   tensor data, tensors back to back in header order, no gaps

Metadata (all values are strings):
  format         "mlx-prefix-disk"
  version        FORMAT_VERSION; any other version is stale
  runtime        "mlx-lm <version>": the cache classes' state layout is mlx-lm's
  model_key      ModelIdentity.key()
  kind           CheckpointKind name
  length         number of tokens
  trimmable      "1" or "0"
  tokens         base64 of the token ids as int32 little-endian
  tokens_digest  blake2b-256 hex of those bytes
  data_digest    blake2b-256 hex of the whole tensor data section
  layers         JSON, one object per model layer:
                 {"cls": "module:QualName", "state": TREE, "children": [LAYER, ...]}
                 TREE: {"@": tensor name} | {"tuple": [TREE...]} | [TREE...] |
                       {"dict": {str: TREE}} | null | bool | int | float | str

File name: blake2b-256 hex of (model_key, 0x00, token bytes) + ".safetensors": equal
names mean equal model and tokens, so a save of a stored checkpoint is a no-op.

Reading the header never reads tensor data (`read_header`): the index is rebuilt from
headers alone. The data digest is checked when a checkpoint is loaded.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import math
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from mlx_prefix.cache.snapshot import LayerSnapshot, Snapshot

FORMAT_NAME = "mlx-prefix-disk"
FORMAT_VERSION = 1
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 256 << 20  # far above any real header (tokens are 4/3 * 4 bytes each)

NAME_RE = re.compile(r"^([0-9a-f]{64})\.safetensors$")
TEMP_RE = re.compile(r"^[0-9a-f]{64}\.safetensors\.tmp-(\d+)-[0-9a-f]+$")

_DIGEST_PLACEHOLDER = "?" * 64  # same width as the hex digest; '?' is in no other field
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
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip

assert sys.byteorder == "little", "the disk format is little-endian"


class DiskFormatError(ValueError):
    """A file that is not a complete, intact checkpoint of this format."""


class StaleFormat(DiskFormatError):
    """A checkpoint file of another format version."""


@dataclass(frozen=True, slots=True)
class FileHeader:
    """What a checkpoint file says about itself, read without its tensor data."""

    version: int
    runtime: str
    model_key: str
    kind: str  # CheckpointKind name
    tokens: tuple[int, ...]
    trimmable: bool
    data_digest: str
    layers: list[Any]  # the decoded `layers` JSON
    tensors: dict[str, tuple[int, int]]  # name -> (begin, end) within the data section
    data_start: int  # file offset of the data section (8 + N)
    size: int  # total file size in bytes


@dataclass(frozen=True, slots=True)
class Encoded:
    """A checkpoint ready to be written: header bytes plus the arrays in data order."""

    header: bytes  # 8-byte length prefix + JSON, data digest still a placeholder
    arrays: tuple[mx.array, ...]
    digest_at: int  # offset of the placeholder in `header`
    size: int  # the file's total size


def runtime_tag() -> str:
    import mlx_lm

    return f"mlx-lm {mlx_lm.__version__}"


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def entry_name(model_key: str, tokens: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(model_key.encode())
    h.update(b"\0")
    h.update(token_bytes(tokens))
    return h.hexdigest() + SUFFIX


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


# -- writing --------------------------------------------------------------------


def encode(
    snapshot: Snapshot, model_key: str, tokens: Sequence[int], kind: str, runtime: str
) -> Encoded:
    """Lay out `snapshot` as a file. Does not mutate; reads no array data.

    Raises ValueError for a state holding something other than arrays, scalars,
    strings, None and (nested) tuples/lists/dicts of them.
    """
    arrays: list[mx.array] = []
    layers = [_encode_layer(layer, arrays) for layer in snapshot.layers]
    tbytes = token_bytes(tokens)
    meta = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "runtime": runtime,
        "model_key": model_key,
        "kind": kind,
        "length": str(len(tokens)),
        "trimmable": "1" if snapshot.trimmable else "0",
        "tokens": base64.b64encode(tbytes).decode(),
        "tokens_digest": _digest(tbytes),
        "data_digest": _DIGEST_PLACEHOLDER,
        "layers": json.dumps(layers, separators=(",", ":")),
    }
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for i, a in enumerate(arrays):
        if a.dtype not in _DTYPES:
            raise ValueError(f"cannot store arrays of dtype {a.dtype}")
        header[f"t{i}"] = {
            "dtype": _DTYPES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text)) + text
    digest_at = blob.find(_DIGEST_PLACEHOLDER.encode())
    if digest_at < 0 or blob.count(_DIGEST_PLACEHOLDER.encode()) != 1:
        raise ValueError("metadata collides with the digest placeholder")
    return Encoded(blob, tuple(arrays), digest_at, len(blob) + offset)


def write(f: BinaryIO, enc: Encoded) -> None:
    """Write `enc` to the binary file `f` (positioned at 0) and fill in the data digest."""
    f.write(enc.header)
    h = hashlib.blake2b(digest_size=32)
    for a in enc.arrays:
        write_array(f, a, h)
    f.seek(enc.digest_at)
    f.write(h.hexdigest().encode())
    f.seek(0, 2)


def write_array(f: BinaryIO, a: mx.array, h: Any) -> None:
    """Append one array's bytes (row-major) to `f` and to the hash `h`."""
    raw = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)  # a C-contiguous copy
    data = memoryview(raw).cast("B") if raw.size else b""
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


def read_header(path: Path) -> FileHeader:
    """Parse and check a checkpoint file's header without reading its tensor data.

    Raises DiskFormatError (StaleFormat for another version) for anything that is not
    a complete checkpoint of this format, OSError if the file cannot be read.
    """
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DiskFormatError(f"truncated: {size} bytes")
        (n,) = struct.unpack("<Q", prefix)
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise DiskFormatError(f"bad header length {n} for a {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        meta = header.pop("__metadata__")
    except (ValueError, KeyError, AttributeError) as e:
        raise DiskFormatError(f"unreadable header: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DiskFormatError("not an mlx-prefix checkpoint")
    try:
        version = int(meta["version"])
        if version != FORMAT_VERSION:
            raise StaleFormat(f"format version {version}, this build reads {FORMAT_VERSION}")
        tbytes = base64.b64decode(meta["tokens"], validate=True)
        if _digest(tbytes) != meta["tokens_digest"]:
            raise DiskFormatError("token ids do not match their digest")
        if len(tbytes) % 4 or len(tbytes) // 4 != int(meta["length"]):
            raise DiskFormatError("token count does not match the stored length")
        tokens = tuple(np.frombuffer(tbytes, dtype="<i4").tolist())
        layers = json.loads(meta["layers"])
        tensors = _check_tensors(header)
        result = FileHeader(
            version=version,
            runtime=str(meta["runtime"]),
            model_key=str(meta["model_key"]),
            kind=str(meta["kind"]),
            tokens=tokens,
            trimmable=meta["trimmable"] == "1",
            data_digest=str(meta["data_digest"]),
            layers=layers,
            tensors=tensors,
            data_start=8 + n,
            size=size,
        )
    except DiskFormatError:
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise DiskFormatError(f"bad metadata: {type(e).__name__}: {e}") from None
    data_len = max((end for _, end in tensors.values()), default=0)
    if result.data_start + data_len != size:
        raise DiskFormatError(f"{size} bytes, header describes {result.data_start + data_len}")
    return result


def _check_tensors(header: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Tensor extents, checked to tile the data section exactly."""
    extents: dict[str, tuple[int, int]] = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        count = math.prod(int(d) for d in shape)
        if dtype not in _ITEMSIZE or end - begin != count * _ITEMSIZE[dtype] or begin < 0:
            raise DiskFormatError(f"tensor {name!r}: bad dtype, shape or extent")
        extents[name] = (int(begin), int(end))
    position = 0
    for begin, end in sorted(extents.values()):
        if begin != position:
            raise DiskFormatError("tensor data has gaps or overlaps")
        position = end
    return extents


def check_data(path: Path, header: FileHeader) -> None:
    """Hash the file's tensor data and compare with the header's digest (reads it all)."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        f.seek(header.data_start)
        while chunk := f.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != header.data_digest:
        raise DiskFormatError("tensor data does not match its digest")


def decode(header: FileHeader, arrays: dict[str, mx.array]) -> Snapshot:
    """Rebuild the Snapshot from a header and its loaded tensors. Does not mutate."""
    if set(arrays) != set(header.tensors):
        raise DiskFormatError("tensors differ from the header")
    layers = tuple(_decode_layer(x, arrays) for x in header.layers)
    return Snapshot(
        length=len(header.tokens),
        trimmable=header.trimmable,
        nbytes=sum(a.nbytes for a in arrays.values()),
        layers=layers,
    )


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
