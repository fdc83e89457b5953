"""The header of a checkpoint file: fields, digests, names; built, read and verified.

A checkpoint file is a standard safetensors file (invariant 8; `mx.load` reads it back):
  [0, 8)       N: header length, little-endian u64
  [8, 8+N)     JSON header, space-padded to a multiple of 8:
               {"__metadata__": {str: str}, "<tensor>": {dtype, shape, data_offsets}, ...}
  [8+N, end)   tensor data, tensors back to back in header order, no gaps
               (written and read by `payload.py`)

Metadata (all values are strings):
  format         "mlx-prefix-disk"
  version        FORMAT_VERSION; any other version is stale
  runtime        "mlx-lm <version>": the cache classes' state layout is mlx-lm's
  model_key      ModelIdentity.key()
  kind           CheckpointKind name
  length         number of tokens
  trimmable      "1" or "0"
  tokens         base64 of the key's token ids as int64 little-endian (an image's
                 placeholders are 62-bit values salted with its hash: vision/key.py;
                 never the image's bytes)
  data_digest    sha256 hex of the whole tensor data section
  header_digest  sha256 hex of bytes [0, 8+N) with this field's value replaced by
                 HEADER_PLACEHOLDER: covers every header byte (shapes, dtypes, offsets,
                 layers, tokens, flags) and, through data_digest, the data
  layers         JSON, one object per model layer (`payload.py`'s layer tree)

File name: blake2b-256 hex of (model_key, 0x00, token bytes) + ".safetensors": equal
names mean equal model and tokens, so a save of a stored checkpoint is a no-op.

Reading a header never reads tensor data (`read_header`): the index is rebuilt from
headers alone, each verified against its digest. Pure Python (no MLX).

Version history: 1 digested only the token ids and the data (a damaged shape or
`layers` field was served); 2 held token ids as int32 (no room for image keys); files
of any version but this one are stale.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

FORMAT_NAME = "mlx-prefix-disk"
FORMAT_VERSION = 3
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 256 << 20  # far above any real header (tokens are 4/3 * 8 bytes each)

NAME_RE = re.compile(r"^([0-9a-f]{64})\.safetensors$")
TEMP_RE = re.compile(r"^[0-9a-f]{64}\.safetensors\.tmp-(\d+)-[0-9a-f]+$")

DATA_PLACEHOLDER = "?" * 64  # same width as a hex digest, filled in after the data
HEADER_PLACEHOLDER = "!" * 64  # what header_digest's value reads as when it is computed
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

# safetensors dtype name -> item size in bytes
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
}

assert sys.byteorder == "little", "the disk format is little-endian"


class DiskFormatError(ValueError):
    """A file that is not a complete, intact checkpoint of this format."""


class StaleFormat(DiskFormatError):
    """A checkpoint file of another format version."""


class ForeignRuntime(Exception):
    """A valid checkpoint written by another runtime (mlx-lm version), e.g. by another
    server sharing the folder: never served here, and not ours to delete."""


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


def runtime_tag() -> str:
    import mlx_lm

    return f"mlx-lm {mlx_lm.__version__}"


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


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
    """How a metadata field is spelled in a header (compact JSON, as `build` writes)."""
    return f'"{name}":"{value}"'.encode()


# -- writing --------------------------------------------------------------------


def build(
    model_key: str,
    tokens: Sequence[int],
    kind: str,
    runtime: str,
    trimmable: bool,
    layers: list[Any],
    tensors: Sequence[TensorInfo],
) -> bytes:
    """The header bytes (length prefix + JSON) of a file holding `tensors` (named t0,
    t1, ... in data order), both digests still placeholders (`seal` fills them in).
    Does not mutate. Raises ValueError if the metadata collides with a placeholder."""
    meta = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "runtime": runtime,
        "model_key": model_key,
        "kind": kind,
        "length": str(len(tokens)),
        "trimmable": "1" if trimmable else "0",
        "tokens": base64.b64encode(token_bytes(tokens)).decode(),
        "data_digest": DATA_PLACEHOLDER,
        "header_digest": HEADER_PLACEHOLDER,
        "layers": json.dumps(layers, separators=(",", ":")),
    }
    header: dict[str, Any] = {"__metadata__": meta}
    for i, t in enumerate(tensors):
        extent = [t.begin, t.end]
        header[f"t{i}"] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": extent}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text)) + text
    for name, value in (("data_digest", DATA_PLACEHOLDER), ("header_digest", HEADER_PLACEHOLDER)):
        if blob.count(value.encode()) != 1 or blob.count(_field(name, value)) != 1:
            raise ValueError("metadata collides with a digest placeholder")
    return blob


def seal(header: bytes, data_digest: str) -> bytes:
    """`header` (from `build`) with the data digest, then the header digest, filled in."""
    header = header.replace(DATA_PLACEHOLDER.encode(), data_digest.encode())
    return header.replace(HEADER_PLACEHOLDER.encode(), header_digest(header).encode())


# -- reading --------------------------------------------------------------------


def read_header(path: Path) -> FileHeader:
    """Parse and verify a checkpoint file's header without reading its tensor data.

    Raises DiskFormatError (StaleFormat for another version) for anything that is not
    a complete, intact checkpoint of this format, OSError if the file cannot be read.
    """
    with open(path, "rb") as f:
        return read_from(f)


def read_from(f: BinaryIO) -> FileHeader:
    """`read_header` on an open binary file; leaves it positioned after the header."""
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
        if len(tbytes) % 8 or len(tbytes) // 8 != int(meta["length"]):
            raise DiskFormatError("token count does not match the stored length")
        tokens = tuple(np.frombuffer(tbytes, dtype="<i8").tolist())
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
        if dtype not in DTYPE_SIZES or not all(_is_size(x) for x in (*shape, begin, end)):
            raise DiskFormatError(f"tensor {name!r}: bad dtype, shape or extent")
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
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
