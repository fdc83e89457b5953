"""What makes two loaded models interchangeable for the prefix cache.

A cached KV/SSM state is only valid for the exact weights, adapter, dtype and chat template
that produced it, so `ModelIdentity.key()` prefixes every cache key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

# Bytes read from a few places in each weight file: fast even for multi-GB checkpoints,
# yet a retrained or re-quantized checkpoint with identical shapes still changes it.
_SAMPLE_BYTES = 64 * 1024
# A safetensors header is JSON (names, dtypes, shapes, offsets); cap what we read of it.
_MAX_HEADER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    source: str  # resolved local path, or "org/repo@<commit sha>"
    adapter: str | None  # resolved adapter folder, None without one
    dtype: str  # floating dtype the weights are held in after loading, e.g. "float32"
    weights_fingerprint: str  # see fingerprint_files()
    chat_template_hash: str  # sha256 prefix of the chat template ("" template if none)
    # This process's part of a model sharded over ranks (engine/sharded/load.py), e.g.
    # "tensor 0/2": its cache holds only that part. None: the whole model.
    shard: str | None = None
    # Its linear-attention layers prefill by the chunked scan (models/linear_scan.py):
    # their states differ in the last bits from the loop's, so neither reads the other's.
    prefill_scan: bool = False

    def key(self) -> str:
        """Short stable hex digest of all fields: the prefix of every prefix-cache key."""
        fields = asdict(self)
        if self.shard is None:
            del fields["shard"]  # keys of unsharded models stay what they were
        if not self.prefill_scan:
            del fields["prefill_scan"]  # as are those of models without the scan
        payload = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]


def fingerprint_files(files: Iterable[Path]) -> str:
    """Hash of file names, sizes and a content sample; small files are hashed whole.

    For `.safetensors` files the sample is the full header (every tensor's name, dtype,
    shape and offset) plus the start, middle and end of the data.
    """
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= 3 * _SAMPLE_BYTES:
                h.update(f.read())
                continue
            if path.suffix == ".safetensors":
                header_len = int.from_bytes(f.read(8), "little")
                h.update(f.read(min(header_len, _MAX_HEADER_BYTES)))
            for offset in (0, size // 2, size - _SAMPLE_BYTES):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def chat_template_hash(template: object) -> str:
    """`template` is a string, a {name: template} dict (older HF configs) or None."""
    payload = json.dumps(template, sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
