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
  data_digest    sha256 hex of the whole tensor data section
  header_digest  sha256 hex of bytes [0, 8+N) with this field's value replaced by
                 HEADER_PLACEHOLDER: covers every header byte (shapes, dtypes, offsets,
                 layers, tokens, flags) and, through data_digest, the data
  layers         JSON, one object per model layer:
                 {"cls": "module:QualName", "state": TREE, "children": [LAYER, ...]}
                 TREE: {"@": tensor name} | {"tuple": [TREE...]} | [TREE...] |
                       {"dict": {str: TREE}} | null | bool | int | float | str

File name: blake2b-256 hex of (model_key, 0x00, token bytes) + ".safetensors": equal
names mean equal model and tokens, so a save of a stored checkpoint is a no-op.

Reading the header never reads tensor data (`read_header`): the index is rebuilt from
headers alone, each verified against its digest. `load` reads a file once, start to
end: header verified, then each tensor read into one buffer that is hashed and turned
into an MLX array (peak memory: the arrays plus one tensor's bytes).

Version history: 1 digested only the token ids and the data (a damaged shape or
`layers` field was served); files of any version but this one are stale.
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
FORMAT_VERSION = 2
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 256 << 20  # far above any real header (tokens are 4/3 * 4 bytes each)

NAME_RE = re.compile(r"^([0-9a-f]{64})\.safetensors$")
TEMP_RE = re.compile(r"^[0-9a-f]{64}\.safetensors\.tmp-(\d+)-[0-9a-f]+$")

DATA_PLACEHOLDER = "?" * 64  # same width as a hex digest, filled in after the data
HEADER_PLACEHOLDER = "!" * 64  # what header_digest's value reads as when it is computed
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
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

assert sys.byteorder == "little", "the disk format is little-endian"


class DiskFormatError(ValueError):
    """A file that is not a complete, intact checkpoint of this format."""


class StaleFormat(DiskFormatError):
    """A checkpoint file of another format version."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, e.g. "F32"
    shape: tuple[int, ...]
    begin: int  # [begin, end): byte range within the data section
    end: int


@dataclass(frozen=True, slots=True)
class FileHeader:
    """What a checkpoint file says about itself, read (and verified) without its data."""

    version: int
    runtime: str
    model_key: str
    kind: str  # CheckpointKind name
    tokens: tuple[int, ...]
    trimmable: bool
    data_digest: str
    layers: list[Any]  # the decoded `layers` JSON
    tensors: dict[str, TensorInfo]  # in data order, tiling the data section
    data_start: int  # file offset of the data section (8 + N)
    size: int  # total file size in bytes


@dataclass(frozen=True, slots=True)
class Encoded:
    """A checkpoint ready to be written: header bytes plus the arrays in data order."""

    header: bytes  # 8-byte length prefix + JSON, both digests still placeholders
    arrays: tuple[mx.array, ...]
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


def header_digest(header: bytes) -> str:
    """The digest of a header (length prefix + JSON) whose header_digest value is
    HEADER_PLACEHOLDER."""
    return hashlib.sha256(header).hexdigest()


def _field(name: str, value: str) -> bytes:
    """How a metadata field is spelled in a header (compact JSON, as `encode` writes)."""
    return f'"{name}":"{value}"'.encode()


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
    meta = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "runtime": runtime,
        "model_key": model_key,
        "kind": kind,
        "length": str(len(tokens)),
        "trimmable": "1" if snapshot.trimmable else "0",
        "tokens": base64.b64encode(token_bytes(tokens)).decode(),
        "data_digest": DATA_PLACEHOLDER,
        "header_digest": HEADER_PLACEHOLDER,
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
    for name, value in (("data_digest", DATA_PLACEHOLDER), ("header_digest", HEADER_PLACEHOLDER)):
        if blob.count(value.encode()) != 1 or blob.count(_field(name, value)) != 1:
            raise ValueError("metadata collides with a digest placeholder")
    return Encoded(blob, tuple(arrays), len(blob) + offset)


def write(f: BinaryIO, enc: Encoded) -> None:
    """Write `enc` to the binary file `f` (positioned at 0), then its header again with
    both digests filled in."""
    f.write(enc.header)
    h = hashlib.sha256()
    for a in enc.arrays:
        write_array(f, a, h)
    header = enc.header.replace(DATA_PLACEHOLDER.encode(), h.hexdigest().encode())
    header = header.replace(HEADER_PLACEHOLDER.encode(), header_digest(header).encode())
    f.seek(0)
    f.write(header)
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
    """Parse and verify a checkpoint file's header without reading its tensor data.

    Raises DiskFormatError (StaleFormat for another version) for anything that is not
    a complete, intact checkpoint of this format, OSError if the file cannot be read.
    """
    with open(path, "rb") as f:
        return _read_header(f)


def load(path: Path, model_key: str, tokens: tuple[int, ...], runtime: str) -> Snapshot:
    """Read the checkpoint of (`model_key`, `tokens`) written by `runtime`, verified.

    Reads the file once: the header is verified and compared with the expected identity
    before any tensor data is read; each tensor's bytes are hashed and become an MLX
    array (evaluated). Raises DiskFormatError for a damaged, stale or different file,
    OSError if it cannot be read. Does not mutate anything on disk.
    """
    with open(path, "rb") as f:
        header = _read_header(f)
        if header.model_key != model_key or header.tokens != tokens:
            raise DiskFormatError("model key or token ids differ from the index")
        if header.runtime != runtime:
            raise DiskFormatError(f"written by {header.runtime}")
        h = hashlib.sha256()
        arrays: dict[str, mx.array] = {}
        f.seek(header.data_start)
        for name, t in header.tensors.items():  # data order: one sequential read
            raw = np.empty(t.end - t.begin, dtype=np.uint8)
            _read_exact(f, memoryview(raw))
            h.update(raw)
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


def _read_header(f: BinaryIO) -> FileHeader:
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
        _verify_header(prefix + raw, meta.get("header_digest"))
        tbytes = base64.b64decode(meta["tokens"], validate=True)
        if len(tbytes) % 4 or len(tbytes) // 4 != int(meta["length"]):
            raise DiskFormatError("token count does not match the stored length")
        tokens = tuple(np.frombuffer(tbytes, dtype="<i4").tolist())
        if not _HEX64.match(meta["data_digest"]):
            raise DiskFormatError("no data digest")
        result = FileHeader(
            version=version,
            runtime=str(meta["runtime"]),
            model_key=str(meta["model_key"]),
            kind=str(meta["kind"]),
            tokens=tokens,
            trimmable={"1": True, "0": False}[meta["trimmable"]],
            data_digest=meta["data_digest"],
            layers=json.loads(meta["layers"]),
            tensors=_check_tensors(header),
            data_start=8 + n,
            size=size,
        )
    except DiskFormatError:
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise DiskFormatError(f"bad metadata: {type(e).__name__}: {e}") from None
    data_len = max((t.end for t in result.tensors.values()), default=0)
    if result.data_start + data_len != size:
        raise DiskFormatError(f"{size} bytes, header describes {result.data_start + data_len}")
    return result


def _verify_header(raw: bytes, digest: Any) -> None:
    """Check the header bytes `raw` (length prefix + JSON) against their digest."""
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise DiskFormatError("no header digest")
    field = _field("header_digest", digest)
    if raw.count(field) != 1:
        raise DiskFormatError("header digest field not where the format puts it")
    if header_digest(raw.replace(field, _field("header_digest", HEADER_PLACEHOLDER))) != digest:
        raise DiskFormatError("header does not match its digest")


def _check_tensors(header: dict[str, Any]) -> dict[str, TensorInfo]:
    """Tensor entries in data order, checked to tile the data section exactly."""
    tensors: list[tuple[str, TensorInfo]] = []
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _FROM_NAME or not all(_is_size(x) for x in (*shape, begin, end)):
            raise DiskFormatError(f"tensor {name!r}: bad dtype, shape or extent")
        if end - begin != math.prod(shape) * _FROM_NAME[dtype][1]:
            raise DiskFormatError(f"tensor {name!r}: extent does not match its shape")
        tensors.append((name, TensorInfo(dtype, tuple(shape), begin, end)))
    tensors.sort(key=lambda x: (x[1].begin, x[1].end))
    position = 0
    for _, t in tensors:
        if t.begin != position:
            raise DiskFormatError("tensor data has gaps or overlaps")
        position = t.end
    return dict(tensors)


def _is_size(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


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
