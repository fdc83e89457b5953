from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from support.models import loaded_test_model
from support.paths import REPO

from mlx_prefix.cache.disk import header as disk_header
from mlx_prefix.cache.disk import payload as disk_payload
from mlx_prefix.cache.disk.tier import DiskCache
from mlx_prefix.cache.snapshot import LayerSnapshot, Snapshot, capture, restore, whole_layers
from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.engine.forward.runner import greedy_continue, prefill
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.request.grid import ChunkGrid

GRID = ChunkGrid(32)
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form. "
HISTORY = CheckpointKind.HISTORY
LOGGER = "mlx_prefix.cache.disk"


def _tokens(model, n: int, offset: int = 0) -> list[int]:
    ids = model.tokenizer.encode(TEXT * 40)[offset : offset + n]
    assert len(ids) == n
    return ids


def _align(tokens):
    return lambda n: GRID.align(tokens, n)


def _prefill(model, tokens, *, cache=None, start=0, capture_at=()):
    """Grid-chunked prefill; returns (cache, last logits, {position: snapshot})."""
    cache = cache if cache is not None else make_prompt_cache(model.model)
    snaps: dict[int, Snapshot] = {}

    def on_boundary(p: int) -> None:
        if p in capture_at:
            snaps[p] = capture(cache, p)

    logits = prefill(model.model, cache, tokens, start, GRID, on_boundary)
    return cache, logits, snaps


def _greedy(model, cache, logits, k: int = 8) -> list[int]:
    return greedy_continue(model.model, cache, logits, k)


def _flat(snapshot: Snapshot) -> list[tuple[str, Any]]:
    """Every class, scalar and array of a snapshot in order, arrays as numpy."""
    out: list[tuple[str, Any]] = []

    def walk(layers, path):
        for i, layer in enumerate(layers):
            out.append((f"{path}{i}.cls", layer.cls))
            for k, v in tree_flatten(list(layer.state)) or []:
                if isinstance(v, mx.array):
                    raw = np.array(v.reshape(-1).view(mx.uint8))
                    out.append((f"{path}{i}.{k}", (str(v.dtype), raw)))
                else:
                    out.append((f"{path}{i}.{k}", (type(v).__name__, v)))
            out.append((f"{path}{i}.shape", _structure(layer.state)))
            walk(layer.children, f"{path}{i}/")

    walk(whole_layers(snapshot), "")  # a chain's pieces concatenated: what a file holds
    return out


def _structure(x: Any) -> Any:
    if isinstance(x, mx.array):
        return ("array", tuple(x.shape))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, [_structure(v) for v in x])
    return type(x).__name__


def _assert_same(a: Snapshot, b: Snapshot) -> None:
    """`a` (loaded) holds what `b` (captured) holds. A capture's nbytes also counts the
    step padding its views keep alive; a loaded snapshot has none."""
    assert (a.length, a.trimmable) == (b.length, b.trimmable)
    assert a.nbytes <= b.nbytes
    fa, fb = _flat(a), _flat(b)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (k, x), (_, y) in zip(fa, fb, strict=True):
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.ndarray):
            assert x[0] == y[0] and np.array_equal(x[1], y[1]), k
        else:
            assert x == y, k


def _cache_states(cache: list) -> list[np.ndarray]:
    arrays = []
    for c in cache:
        for x in c.caches if isinstance(c, CacheList) else [c]:
            arrays += [
                np.array(a.view(mx.uint8))
                for _, a in tree_flatten(x.state)
                if isinstance(a, mx.array)
            ]
    return arrays


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= 30]


# -- real snapshots from the tiny test models ------------------------------------


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "sliding", "nemotron_h"])
def test_save_scan_load_restore_is_bit_identical(tmp_path: Path, kind: str):
    model = loaded_test_model(kind)
    key = model.identity.key()
    prompt = _tokens(model, 96)
    request = prompt + _tokens(model, 20, offset=200)
    _, _, snaps = _prefill(model, prompt, capture_at=(64, 96))
    saver = DiskCache(tmp_path)
    assert saver.save(key, prompt[:64], snaps[64], CheckpointKind.PERIODIC)
    assert saver.save(key, prompt, snaps[96], HISTORY)  # the end of prefill

    disk = DiskCache(tmp_path)  # a fresh index, rebuilt by scan
    match = disk.match(key, request, _align(request))
    assert match is not None and (match.reuse_tokens, match.trim) == (96, 0)
    assert match.kind is HISTORY
    loaded = disk.load(match)
    assert loaded is not None and disk.stats().hits == 1
    _assert_same(loaded, snaps[96])
    assert _same_arrays(_cache_states(restore(loaded)), _cache_states(restore(snaps[96])))

    # The restored request computes the same chunks as a cold run: identical logits.
    cold_cache, cold_logits, _ = _prefill(model, request)
    warm_cache, warm_logits, _ = _prefill(model, request, cache=restore(loaded), start=96)
    assert np.array_equal(np.array(cold_logits), np.array(warm_logits))
    assert _greedy(model, warm_cache, warm_logits) == _greedy(model, cold_cache, cold_logits)
    disk.check_integrity()


def _same_arrays(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_trimmable_match_trims_the_loaded_snapshot(tmp_path: Path):
    model = loaded_test_model("dense")
    key = model.identity.key()
    prompt = _tokens(model, 96)
    _, _, snaps = _prefill(model, prompt, capture_at=(96,))
    DiskCache(tmp_path).save(key, prompt, snaps[96], HISTORY)
    request = prompt[:70] + _tokens(model, 30, offset=300)  # diverges at 70
    disk = DiskCache(tmp_path)
    match = disk.match(key, request, _align(request))
    assert match is not None and (match.reuse_tokens, match.trim) == (64, 32)
    loaded = disk.load(match)
    assert loaded is not None
    cold_cache, cold_logits, _ = _prefill(model, request)
    warm_cache, warm_logits, _ = _prefill(model, request, cache=restore(loaded, 32), start=64)
    assert np.array_equal(np.array(cold_logits), np.array(warm_logits))


def _synthetic_caches() -> dict[str, list[Any]]:
    def kv(n, d=16, seed=0):
        return (
            mx.random.normal((1, 2, n, d), key=mx.random.key(seed)),
            mx.random.normal((1, 2, n, d), key=mx.random.key(seed + 1)),
        )

    out: dict[str, list[Any]] = {}
    c = KVCache()
    c.update_and_fetch(*kv(10))
    out["kv_bf16"] = [c]
    c.keys, c.values = c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16)
    q = QuantizedKVCache(group_size=32, bits=8)
    q.update_and_fetch(*kv(10, 32))
    out["quantized"] = [q]
    ch = ChunkedKVCache(chunk_size=64)
    ch.update_and_fetch(*kv(12))
    out["chunked"] = [ch]
    r = RotatingKVCache(max_size=16, keep=2)
    r.update_and_fetch(*kv(12))
    r.update_and_fetch(*kv(9, seed=5))  # wrapped
    out["rotating_wrapped"] = [r]
    a = ArraysCache(size=3)
    a[0] = mx.random.normal((1, 3, 16))
    a[2] = mx.arange(6, dtype=mx.int32)
    k2 = KVCache()
    k2.update_and_fetch(*kv(21))
    out["mixed_with_cachelist"] = [CacheList(KVCache(), ArraysCache(size=2)), a, k2]
    out["mixed_with_cachelist"][0].caches[0].update_and_fetch(*kv(21, seed=9))
    out["mixed_with_cachelist"][0].caches[1][1] = mx.ones((1, 4))
    return out


@pytest.mark.parametrize("name", sorted(_synthetic_caches()))
def test_every_cache_class_round_trips(tmp_path: Path, name: str):
    cache = _synthetic_caches()[name]
    length = {"kv_bf16": 10, "quantized": 10, "chunked": 12, "rotating_wrapped": 21}.get(name, 21)
    snap = capture(cache, length)
    tokens = list(range(100, 100 + length))
    assert DiskCache(tmp_path).save("m", tokens, snap, HISTORY)
    disk = DiskCache(tmp_path)
    match = disk.match("m", tokens + [1], lambda n: n)
    assert match is not None and match.reuse_tokens == length
    loaded = disk.load(match)
    assert loaded is not None
    _assert_same(loaded, snap)
    assert _same_arrays(_cache_states(restore(loaded)), _cache_states(restore(snap)))


def _child_env() -> dict[str, str]:
    """This environment (the preloaded BLAS included) with the checkout importable."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


_CHILD = textwrap.dedent(
    """
    import json, sys
    from mlx_prefix.cache.disk.tier import DiskCache
    from mlx_prefix.cache.snapshot import restore
    from mlx_prefix.engine.forward.runner import greedy_continue, prefill
    from mlx_prefix.models.load import load_model
    from mlx_prefix.prompt.request.grid import ChunkGrid

    model_path, directory, tokens_json = sys.argv[1:4]
    tokens = json.loads(tokens_json)
    model = load_model(model_path)
    grid = ChunkGrid(32)
    disk = DiskCache(directory)
    match = disk.match(model.identity.key(), tokens, lambda n: grid.align(tokens, n))
    snapshot = disk.load(match) if match is not None else None
    cache = restore(snapshot, match.trim) if snapshot is not None else None
    reuse = match.reuse_tokens if snapshot is not None else 0
    if cache is None:
        from mlx_lm.models.cache import make_prompt_cache
        cache = make_prompt_cache(model.model)
    logits = prefill(model.model, cache, tokens, reuse, grid, lambda p: None)
    out = greedy_continue(model.model, cache, logits, 8)
    print(json.dumps({"reuse": reuse, "tokens": out, "hits": disk.stats().hits}))
    """
)


def test_restart_in_a_new_process_hits_and_answers_like_a_cold_run(tmp_path: Path):
    kind = "qwen3_5"
    model = loaded_test_model(kind)
    prompt = _tokens(model, 96)
    request = prompt + _tokens(model, 20, offset=200)
    _, _, snaps = _prefill(model, prompt, capture_at=(96,))
    assert DiskCache(tmp_path).save(model.identity.key(), prompt, snaps[96], HISTORY)
    cold_cache, cold_logits, _ = _prefill(model, request)
    cold = _greedy(model, cold_cache, cold_logits)

    env = _child_env()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(cached_test_model(kind)),
            str(tmp_path),
            json.dumps(request),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["reuse"] == 96 and result["hits"] == 1, "the new process missed the disk"
    assert result["tokens"] == cold


# -- damaged, stale and foreign files --------------------------------------------


@pytest.fixture
def saved(tmp_path: Path):
    """One stored dense checkpoint: (dir, model key, tokens, path)."""
    model = loaded_test_model("dense")
    key = model.identity.key()
    prompt = _tokens(model, 64)
    _, _, snaps = _prefill(model, prompt, capture_at=(64,))
    assert DiskCache(tmp_path).save(key, prompt, snaps[64], HISTORY)
    (path,) = tmp_path.iterdir()
    return tmp_path, key, prompt, path


def _rewrite_meta(path: Path, *, sign: bool = True, **changes: str | None) -> None:
    """Change metadata fields (None: delete). Signed, the header gets a valid digest: a
    file some writer produced that way; unsigned, the old digest stays: damage."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header["__metadata__"]
    meta.update(changes)
    for k in [k for k, v in meta.items() if v is None]:
        del meta[k]
    if sign:
        meta["header_digest"] = disk_header.HEADER_PLACEHOLDER
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text)) + text
    if sign:
        digest = disk_header.header_digest(blob).encode()
        blob = blob.replace(disk_header.HEADER_PLACEHOLDER.encode(), digest)
    path.write_bytes(blob + raw[8 + n :])


def _edit_header(path: Path, old: bytes, new: bytes) -> None:
    """Replace `old` by `new` (same length) once in the header bytes: damage."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert len(old) == len(new) and old in raw[: 8 + n], old
    path.write_bytes(raw.replace(old, new, 1))


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def _swap_shape(path: Path) -> None:
    """The reviewer's repro: [1, 2, 64, 16] -> [1, 64, 2, 16] (same size and bytes)."""
    b, h, n, d = _header(path)["t0"]["shape"]
    _edit_header(path, f'"shape":[{b},{h},{n},{d}]'.encode(), f'"shape":[{b},{n},{h},{d}]'.encode())


def _write_v1(path: Path) -> None:
    """Rewrite a checkpoint as format version 1 wrote it: token ids and data digested
    (blake2b), nothing else."""
    import base64
    import hashlib

    meta = _header(path)["__metadata__"]
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    tbytes = base64.b64decode(meta["tokens"])
    _rewrite_meta(
        path,
        sign=False,
        version="1",
        header_digest=None,
        tokens_digest=hashlib.blake2b(tbytes, digest_size=32).hexdigest(),
        data_digest=hashlib.blake2b(raw[8 + n :], digest_size=32).hexdigest(),
    )


def _write_v2(path: Path) -> None:
    """Rewrite a checkpoint as format version 2 wrote it: token ids as int32, the header
    signed as version 2 signed it (read as int64 they would be other tokens)."""
    import base64

    import numpy as np

    meta = _header(path)["__metadata__"]
    ids = np.frombuffer(base64.b64decode(meta["tokens"]), dtype="<i8").astype("<i4")
    _rewrite_meta(path, version="2", tokens=base64.b64encode(ids.tobytes()).decode())


def _request(tokens: list[int]) -> list[int]:
    return tokens + [7, 8, 9]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "header describes"),  # truncated
        (lambda p: p.write_bytes(p.read_bytes()[:5]), "truncated"),
        (lambda p: p.write_bytes(b"\xff" * 8 + p.read_bytes()[8:]), "header length"),
        (lambda p: p.write_bytes(p.read_bytes()[:8] + b"x" + p.read_bytes()[9:]), "unreadable"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 8), "header describes"),
        (lambda p: _rewrite_meta(p, version="99"), "format version 99"),
        (_write_v1, "format version 1"),
        (_write_v2, "format version 2"),
        (lambda p: _rewrite_meta(p, format="something-else"), "not an mlx-prefix"),
        (lambda p: _rewrite_meta(p, length="3"), "length"),
        (lambda p: _rewrite_meta(p, trimmable="yes"), "bad metadata"),
        (lambda p: _rewrite_meta(p, sign=False, header_digest=None), "no header digest"),
        (lambda p: _rewrite_meta(p, sign=False, data_digest="0" * 64), "header does not match"),
        (_swap_shape, "header does not match its digest"),
        (lambda p: _edit_header(p, b'"trimmable":"1"', b'"trimmable":"0"'), "header does not"),
        (lambda p: _edit_header(p, b'"kind":"HISTORY",', b'"kind":"SYSTEM" ,'), "header does"),
        (lambda p: _edit_header(p, b"},64]", b"},32]"), "header does not match"),  # KV offset
        (lambda p: _edit_header(p, b'"F32"', b'"I32"'), "header does not match"),
    ],
    ids=[
        "truncated",
        "stub",
        "bad_length",
        "bad_json",
        "appended",
        "version",
        "version_1",
        "version_2",
        "format",
        "count",
        "trimmable_value",
        "no_header_digest",
        "data_digest_changed",
        "shape_swapped",
        "trimmable_flipped",
        "kind_changed",
        "layer_offset_changed",
        "dtype_changed",
    ],
)
def test_bad_files_are_removed_by_scan(saved, caplog, damage, message):
    d, key, tokens, path = saved
    damage(path)
    with caplog.at_level(logging.WARNING, LOGGER):
        disk = DiskCache(d)
    assert any(message in m and path.name in m for m in _warnings(caplog)), _warnings(caplog)
    assert not path.exists()
    assert disk.stats().files == 0 and disk.stats().removed == 1
    assert disk.match(key, _request(tokens), _align(_request(tokens))) is None


def test_tokens_not_matching_the_name_are_removed(saved, caplog):
    d, key, tokens, path = saved
    import base64

    other = disk_header.token_bytes([t + 1 for t in tokens])
    _rewrite_meta(path, tokens=base64.b64encode(other).decode())  # a valid header
    with caplog.at_level(logging.WARNING, LOGGER):
        disk = DiskCache(d)
    assert any("do not match the file name" in m for m in _warnings(caplog))
    assert not path.exists() and disk.stats().files == 0


def _valid_file_of(d: Path, key: str, tokens: list[int]) -> Path:
    """A valid checkpoint of (key, tokens) written into the folder `d`."""
    model = loaded_test_model("dense")
    _, _, snaps = _prefill(model, tokens, capture_at=(len(tokens),))
    assert DiskCache(d).save(key, tokens, snaps[len(tokens)], HISTORY)
    return d / disk_header.entry_name(key, tokens)


def _swap_in(path: Path, source: Path) -> None:
    os.replace(source, path)


@pytest.mark.parametrize(
    "change, message",
    [
        ("other_tokens", "differ from the index"),
        ("other_model", "differ from the index"),
        ("version_1", "format version 1"),
        ("shape_swapped", "header does not match its digest"),
        ("offset_changed", "header does not match its digest"),
        ("truncated", "header describes"),
        ("data_flipped", "tensor data does not match its digest"),
    ],
)
def test_a_file_changed_after_the_scan_is_not_served(
    saved, tmp_path_factory, caplog, change, message
):
    d, key, tokens, path = saved
    disk = DiskCache(d)
    req = _request(tokens)
    match = disk.match(key, req, _align(req))
    assert match is not None
    other_dir = tmp_path_factory.mktemp("other")
    if change == "other_tokens":  # a valid checkpoint, but not of these tokens
        model = loaded_test_model("dense")
        _swap_in(path, _valid_file_of(other_dir, key, _tokens(model, 64, offset=100)))
    elif change == "other_model":  # the same tokens, another model
        _swap_in(path, _valid_file_of(other_dir, "another-model", tokens))
    elif change == "version_1":
        _write_v1(path)
    elif change == "shape_swapped":
        _swap_shape(path)
    elif change == "offset_changed":
        _edit_header(path, b"},64]", b"},32]")
    elif change == "truncated":
        path.write_bytes(path.read_bytes()[:-4])
    else:
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, LOGGER):
        assert disk.load(match) is None
    assert any(message in m for m in _warnings(caplog)), _warnings(caplog)
    assert not path.exists() and disk.match(key, req, _align(req)) is None
    assert disk.stats().load_failures == 1 and disk.stats().hits == 0
    disk.check_integrity()


def test_another_runtimes_file_is_not_served_and_not_deleted(saved, caplog):
    # Two servers of different mlx-lm versions sharing the folder write the same name:
    # the other's file is valid, only not ours.
    d, key, tokens, path = saved
    disk = DiskCache(d)
    req = _request(tokens)
    match = disk.match(key, req, _align(req))
    _rewrite_meta(path, runtime="mlx-lm 0.0.1")
    with caplog.at_level(logging.WARNING, LOGGER):
        assert disk.load(match) is None
    assert any("written by mlx-lm 0.0.1" in m for m in _warnings(caplog)), _warnings(caplog)
    assert path.exists() and disk.match(key, req, _align(req)) is None
    assert disk.stats().load_failures == 1 and disk.stats().removed == 0
    disk.check_integrity()


@pytest.mark.parametrize(
    "error", [MemoryError(), OSError(errno.EMFILE, os.strerror(errno.EMFILE))], ids=repr
)
def test_a_transient_load_error_keeps_the_file(saved, monkeypatch, caplog, error):
    d, key, tokens, path = saved
    disk = DiskCache(d)
    req = _request(tokens)
    match = disk.match(key, req, _align(req))

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(disk_payload, "open", failing, raising=False)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert disk.load(match) is None
    assert any("the file is kept" in m and path.name in m for m in _warnings(caplog))
    assert path.exists() and disk.stats().load_failures == 1 and disk.stats().removed == 0
    monkeypatch.undo()
    again = disk.match(key, req, _align(req))  # still indexed: the next request loads it
    assert again is not None and disk.load(again) is not None
    assert disk.stats().hits == 1
    disk.check_integrity()


def test_load_reads_the_file_once(saved, monkeypatch):
    d, key, tokens, path = saved
    disk = DiskCache(d)
    match = disk.match(key, _request(tokens), _align(_request(tokens)))
    assert match is not None
    opened: list[Any] = []

    class Counting:
        def __init__(self, f):
            self.f, self.read_bytes = f, 0
            opened.append(self)

        def read(self, n=-1):
            data = self.f.read(n)
            self.read_bytes += len(data)
            return data

        def readinto(self, b):
            n = self.f.readinto(b)
            self.read_bytes += n or 0
            return n

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def counting_open(*args, **kwargs):
        return Counting(open(*args, **kwargs))

    def no_load(*args, **kwargs):
        raise AssertionError("mx.load reads the file a second time")

    monkeypatch.setattr(disk_payload, "open", counting_open, raising=False)
    monkeypatch.setattr(mx, "load", no_load)
    loaded = disk.load(match)
    monkeypatch.undo()
    assert loaded is not None and disk.stats().hits == 1
    assert [f.read_bytes for f in opened] == [path.stat().st_size]
    fresh = DiskCache(d).load(match)
    assert fresh is not None
    _assert_same(loaded, fresh)


def test_every_dtype_and_empty_and_scalar_arrays_round_trip(tmp_path: Path):
    values = np.arange(-6, 6).reshape(3, 4)
    arrays = [mx.array(values).astype(dtype) for dtype in disk_payload._DTYPES]
    arrays += [mx.zeros((1, 0, 4)), mx.array(7, dtype=mx.int32), mx.array([1.5], mx.bfloat16)]
    layer = LayerSnapshot(KVCache, tuple(arrays))
    nbytes = sum(a.nbytes for a in arrays)
    snap = Snapshot(length=3, trimmable=True, nbytes=nbytes, layers=(layer,))
    assert DiskCache(tmp_path).save("m", [1, 2, 3], snap, HISTORY)
    disk = DiskCache(tmp_path)
    match = disk.match("m", [1, 2, 3, 4], lambda n: n)
    assert match is not None
    loaded = disk.load(match)
    assert loaded is not None
    _assert_same(loaded, snap)
    assert loaded.nbytes == nbytes
    assert [a.dtype for a in loaded.layers[0].state] == [a.dtype for a in arrays]


def test_files_of_another_model_are_kept_but_never_matched(saved, caplog):
    d, key, tokens, path = saved
    snap = DiskCache(d).load(DiskCache(d).match(key, _request(tokens), _align(_request(tokens))))
    assert snap is not None
    assert DiskCache(d).save("another-model", tokens, snap, HISTORY)
    with caplog.at_level(logging.WARNING, LOGGER):
        disk = DiskCache(d)
    assert not _warnings(caplog)
    assert disk.stats().files == 2 and len(disk.entries("another-model")) == 1
    foreign = disk.entries("another-model")[0].name
    req = _request(tokens)
    match = disk.match(key, req, _align(req))
    assert match is not None and match.name == path.name  # our own file, never the other
    disk.clear(key)
    assert disk.match(key, req, _align(req)) is None
    assert (d / foreign).exists()
    assert disk.match("another-model", req, _align(req)) is not None


def test_files_of_another_mlx_lm_version_are_kept_but_never_matched(saved):
    d, key, tokens, path = saved
    _rewrite_meta(path, runtime="mlx-lm 0.0.1")
    disk = DiskCache(d)
    assert disk.stats().files == 1 and path.exists()
    assert disk.match(key, _request(tokens), _align(_request(tokens))) is None
    assert disk.sequences(key) == []  # what cannot serve this model is not listed for it


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftover_temp_files_are_removed_and_other_files_left_alone(saved, caplog):
    d, key, tokens, path = saved
    dead = d / f"{path.name}.tmp-{_dead_pid()}-0a1b2c3d"
    dead.write_bytes(path.read_bytes()[:1000])
    live = d / f"{path.name}.tmp-{_dead_pid()}-1a1b2c3d"  # being written: its lock is held
    live.write_bytes(b"x")
    reused = d / f"{path.name}.tmp-{os.getpid()}-2a1b2c3d"  # a killed writer with our pid
    reused.write_bytes(b"x")
    opening = d / f"{path.name}.tmp-{os.getpid()}-3a1b2c3d"  # created, not locked yet
    opening.write_bytes(b"")
    lookalikes = [
        d / "notes.txt",
        d / f"{path.name}.tmp",
        d / f"{path.name}.tmp-12-xyz",
        d / f"{path.name[:-12]}.tmp-12-0a1b",
    ]
    for p in lookalikes:
        p.write_text("mine")
    with open(live, "rb") as held, caplog.at_level(logging.WARNING, LOGGER):
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        disk = DiskCache(d)
    warned = _warnings(caplog)
    assert any("unfinished write" in m and dead.name in m for m in warned)
    assert any("unfinished write" in m and reused.name in m for m in warned)
    assert not dead.exists() and not reused.exists()
    assert live.exists() and opening.exists() and all(p.exists() for p in lookalikes)
    assert disk.stats().files == 1 and disk.stats().removed == 2


_KILLED_CHILD = textwrap.dedent(
    """
    import os, sys, time
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from mlx_prefix.cache.disk import payload as disk_payload
    from mlx_prefix.cache.disk.tier import DiskCache
    from mlx_prefix.cache.snapshot import capture
    from mlx_prefix.cache.store import CheckpointKind

    stage, directory = sys.argv[1:3]
    cache = [KVCache() for _ in range(4)]
    for c in cache:  # 4 layers x 2 x 4 MiB
        c.update_and_fetch(mx.random.normal((1, 8, 1024, 128)), mx.random.normal((1, 8, 1024, 128)))
    snapshot = capture(cache, 1024)
    if stage == "data":
        write_array, written = disk_payload.write_array, []
        def stall(f, a, h):
            write_array(f, a, h)
            written.append(a)
            if len(written) == 3:
                f.flush()
                print("stalled", flush=True)
                time.sleep(600)
        disk_payload.write_array = stall
    else:
        def stall(src, dst):
            print("stalled", flush=True)
            time.sleep(600)
        os.replace = stall
    DiskCache(directory).save("m", list(range(1024)), snapshot, CheckpointKind.HISTORY)
    """
)


@pytest.mark.parametrize("stage", ["data", "replace"])
def test_kill_9_during_a_write_leaves_nothing_servable(tmp_path: Path, caplog, stage: str):
    env = _child_env()
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, stage, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stalled"
        (temp,) = tmp_path.iterdir()
        assert ".tmp-" in temp.name and temp.stat().st_size > 1 << 20
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, LOGGER):
        disk = DiskCache(tmp_path)
    assert disk.stats().files == 0 and _files(tmp_path) == []
    assert any("unfinished write" in m for m in _warnings(caplog))
    assert disk.match("m", list(range(2000)), lambda n: n) is None


# -- budget and failures ------------------------------------------------------------


def _kv_cache(n: int, seed: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(
        mx.random.normal((1, 2, n, 16), key=mx.random.key(seed)),
        mx.random.normal((1, 2, n, 16), key=mx.random.key(seed + 1)),
    )
    return c


def _kv_snapshot(n: int, seed: int) -> Snapshot:
    return capture([_kv_cache(n, seed)], n)


def _seq(first: int, n: int = 32) -> list[int]:
    return [first] + list(range(1000, 1000 + n - 1))  # distinct first tokens: no prefixes


def test_budget_evicts_least_recently_accessed(tmp_path: Path):
    probe = DiskCache(tmp_path / "probe")
    assert probe.save("m", _seq(1), _kv_snapshot(32, 0), HISTORY)
    size = probe.stats().bytes  # every file below has this size
    disk = DiskCache(tmp_path / "c", budget_bytes=int(2.5 * size))
    a, b, c = _seq(1), _seq(2), _seq(3)
    assert disk.save("m", a, _kv_snapshot(32, 1), HISTORY)
    assert disk.save("m", b, _kv_snapshot(32, 2), HISTORY)
    match = disk.match("m", a + [5], lambda n: n)
    assert match is not None and disk.load(match) is not None  # a is now the most recent
    assert disk.save("m", c, _kv_snapshot(32, 3), HISTORY)
    assert disk.stats().evictions == 1 and disk.stats().bytes <= int(2.5 * size)
    assert disk.match("m", b + [5], lambda n: n) is None
    assert disk.match("m", a + [5], lambda n: n) is not None
    assert disk.match("m", c + [5], lambda n: n) is not None
    disk.check_integrity()

    # Recency survives a restart (file mtimes): c was used last, so a goes first.
    listing = DiskCache(tmp_path / "c", budget_bytes=None)  # lists, never evicts
    assert len(listing.entries()) == 2 and listing.stats().budget_bytes is None
    smaller = DiskCache(tmp_path / "c", budget_bytes=int(1.5 * size))
    assert [e.tokens for e in smaller.entries()] == [32]
    assert smaller.match("m", c + [5], lambda n: n) is not None
    assert len(list((tmp_path / "c").iterdir())) == 1


def test_recency_survives_a_restart_when_accesses_share_a_clock_tick(tmp_path: Path, monkeypatch):
    # The kernel's file times advance in ticks: accesses within one read the same clock.
    # Every access is stamped after the one before it, so a restart keeps their order.
    import mlx_prefix.cache.disk.tier as disk_module

    frozen = 1_800_000_000_000_000_000
    monkeypatch.setattr(disk_module.time, "time_ns", lambda: frozen)
    disk = DiskCache(tmp_path, budget_bytes=None)
    seqs = [_seq(first) for first in (3, 1, 2)]  # the files' names sort in another order
    for i, tokens in enumerate(seqs):
        assert disk.save("m", tokens, _kv_snapshot(32, i), HISTORY)
    match = disk.match("m", seqs[0] + [5], lambda n: n)
    assert match is not None and disk.load(match) is not None  # the first is now the newest
    order = [seqs[1], seqs[2], seqs[0]]
    assert [e.tokens for e in disk.sequences("m")] == [tuple(t) for t in order]
    stamps = [(tmp_path / e.info.name).stat().st_mtime_ns for e in disk.sequences("m")]
    assert frozen < stamps[0] < stamps[1] < stamps[2] < frozen + 10**6
    again = DiskCache(tmp_path, budget_bytes=None)
    assert [e.tokens for e in again.sequences("m")] == [tuple(t) for t in order]


def test_every_deletion_is_logged_with_its_reason(tmp_path: Path, caplog):
    probe = DiskCache(tmp_path / "probe")
    assert probe.save("m", _seq(1), _kv_snapshot(32, 0), HISTORY)
    size = probe.stats().bytes
    folder = tmp_path / "c"
    disk = DiskCache(folder, budget_bytes=int(1.5 * size))
    names = {}
    for first in (1, 2, 3):
        assert disk.save("m", _seq(first), _kv_snapshot(32, first), HISTORY)
        names[first] = disk.entries()[-1].name
    with caplog.at_level(logging.INFO, LOGGER):
        disk.set_budget(None)  # nothing evicted: no line
        assert not caplog.records
        DiskCache(folder, budget_bytes=1)  # a smaller budget at startup (another server)

    def lines(name: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if name in r.getMessage()]

    (line,) = lines(names[3])
    assert "evicting" in line and "at startup" in line and f"{size} bytes" in line
    long = _seq(7, 48)
    full = _kv_snapshot(48, 0)
    caplog.clear()
    with caplog.at_level(logging.INFO, LOGGER):
        assert disk.save("m", long[:32], capture(restore(full, trim=16), 32), HISTORY)
        short = disk.entries()[-1].name
        assert disk.save("m", long, full, HISTORY)  # the 32-token file is now redundant
        (line,) = lines(short)
        assert "removing" in line and "serves it by trimming" in line
        assert disk.clear("m") >= 1
    assert any("cleared" in r.getMessage() for r in caplog.records)


def test_a_failed_mtime_update_is_logged(tmp_path: Path, monkeypatch, caplog):
    disk = DiskCache(tmp_path)
    assert disk.save("m", _seq(1), _kv_snapshot(32, 0), HISTORY)

    def failing(*args, **kwargs):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "utime", failing)
    match = disk.match("m", _seq(1) + [5], lambda n: n)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert disk.load(match) is not None
    (line,) = _warnings(caplog)
    assert "mtime" in line and match.name in line and os.strerror(errno.EPERM) in line


def test_a_checkpoint_larger_than_the_budget_is_not_saved(tmp_path: Path):
    disk = DiskCache(tmp_path, budget_bytes=1000)
    assert not disk.save("m", _seq(1), _kv_snapshot(32, 0), HISTORY)
    assert _files(tmp_path) == [] and disk.stats().save_failures == 1


def test_saves_are_deduplicated_and_trimmable_prefixes_dropped(tmp_path: Path):
    disk = DiskCache(tmp_path)
    long = _seq(1, 48)
    full = _kv_snapshot(48, 0)
    short_snap = capture(restore(full, trim=16), 32)
    assert disk.save("m", long[:32], short_snap, HISTORY)
    assert disk.save("m", long, full, HISTORY)  # serves the 32-token prefix by trimming
    assert [e.tokens for e in disk.entries()] == [48] and len(_files(tmp_path)) == 1
    assert disk.save("m", long[:32], short_snap, HISTORY)  # covered: nothing written
    assert disk.save("m", long, full, HISTORY)  # duplicate: nothing written
    assert disk.stats().saves == 2 and len(_files(tmp_path)) == 1
    disk.check_integrity()


@pytest.mark.parametrize(
    "target, err",
    [
        ("open", errno.EROFS),
        ("open", errno.EACCES),
        ("fsync", errno.ENOSPC),
        ("replace", errno.ENOSPC),
    ],
)
def test_an_unwritable_directory_fails_softly(tmp_path: Path, monkeypatch, caplog, target, err):
    real = {"open": os.open, "fsync": os.fsync, "replace": os.replace}[target]

    def failing(*args, **kwargs):
        if target != "open" or ".tmp-" in str(args[0]):
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    disk = DiskCache(tmp_path)
    monkeypatch.setattr(os, target, failing)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert disk.save("m", _seq(1), _kv_snapshot(32, 0), HISTORY) is False
        assert disk.save("m", _seq(2), _kv_snapshot(32, 1), HISTORY) is False
    assert len(_warnings(caplog)) == 1, "one warning, not one per save"
    assert os.strerror(err) in _warnings(caplog)[0]
    assert _files(tmp_path) == [], "a partial file was left behind"
    assert disk.stats().save_failures == 2 and disk.stats().files == 0
    monkeypatch.undo()
    assert disk.save("m", _seq(1), _kv_snapshot(32, 0), HISTORY)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_a_read_only_directory_fails_softly(tmp_path: Path, caplog):
    disk = DiskCache(tmp_path)
    tmp_path.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, LOGGER):
            assert not disk.save("m", _seq(1), _kv_snapshot(32, 0), HISTORY)
        assert _warnings(caplog)
    finally:
        tmp_path.chmod(0o755)


@pytest.mark.parametrize(
    "error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), MemoryError("no room")]
)
def test_a_failure_while_writing_data_fails_softly(tmp_path: Path, monkeypatch, caplog, error):
    real, calls = disk_payload.write_array, []

    def fail_second(f, a, h):  # the disk fills up after the first array
        calls.append(a)
        if len(calls) % 2 == 0:
            raise error
        real(f, a, h)

    disk = DiskCache(tmp_path)
    monkeypatch.setattr(disk_payload, "write_array", fail_second)
    snap = capture([_kv_cache(32, 0)], 32)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert disk.save("m", _seq(1), snap, HISTORY) is False
        assert disk.save("m", _seq(2), snap, HISTORY) is False
    warned = _warnings(caplog)
    assert len(warned) == (1 if isinstance(error, OSError) else 2), warned
    assert "disk full" in warned[0] or "MemoryError" in warned[0]
    assert _files(tmp_path) == [], "a partial file was left behind"
    assert disk.stats().save_failures == 2 and disk.stats().files == 0
    monkeypatch.undo()
    assert disk.save("m", _seq(1), snap, HISTORY)
    assert disk.match("m", _seq(1) + [5], lambda n: n) is not None


def test_entries_clear_and_stats(tmp_path: Path):
    disk = DiskCache(tmp_path)
    assert disk.save("a", _seq(1), _kv_snapshot(32, 0), HISTORY)
    assert disk.save("a", _seq(2), _kv_snapshot(32, 1), CheckpointKind.SYSTEM)
    assert disk.save("b", _seq(1), _kv_snapshot(32, 2), HISTORY)
    assert {e.kind for e in disk.entries("a")} == {"HISTORY", "SYSTEM"}
    listed = disk.sequences("a")
    assert sorted(s.tokens for s in listed) == sorted([tuple(_seq(1)), tuple(_seq(2))])
    assert all(s.info.model_key == "a" and s.info.tokens == len(s.tokens) for s in listed)
    assert all(e.trimmable and e.tokens == 32 for e in disk.entries())
    stats = disk.stats()
    assert (
        stats.files == 3
        and stats.saves == 3
        and stats.bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    )
    assert disk.clear("a") == 2 and disk.stats().files == 1
    assert disk.clear() == 1 and _files(tmp_path) == []
    assert disk.match("b", _seq(1) + [1], lambda n: n) is None
    assert disk.stats().misses == 1
    disk.check_integrity()


def test_non_trimmable_entries_match_only_exact_grid_prefixes(tmp_path: Path):
    model = loaded_test_model("qwen3_5")
    key = model.identity.key()
    prompt = _tokens(model, 100)
    _, _, snaps = _prefill(model, prompt, capture_at=(32, 64, 100))
    disk = DiskCache(tmp_path)
    for p, s in snaps.items():
        assert not s.trimmable
        assert disk.save(key, prompt[:p], s, HISTORY)
    # 100 is not on the grid: the longest usable one is 64.
    match = disk.match(key, prompt + [5], _align(prompt + [5]))
    assert match is not None and (match.reuse_tokens, match.trim) == (64, 0)
    # Never the whole prompt: at least one token is left to compute.
    match = disk.match(key, prompt[:64], _align(prompt[:64]))
    assert match is not None and match.reuse_tokens == 32
    # Diverging inside an entry: fall back to the longest stored prefix.
    diverged = prompt[:50] + [9] * 30
    match = disk.match(key, diverged, _align(diverged))
    assert match is not None and match.reuse_tokens == 32


# -- read-only listing (mlx-prefix cache ls) ------------------------------------------


def _tree_state(d: Path) -> dict[str, tuple[int, float]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime) for p in d.iterdir()}


def test_listing_changes_nothing_and_reports_bad_files(saved, caplog):
    d, key, tokens, path = saved
    assert DiskCache(d).save("another-model", _seq(1), _kv_snapshot(32, 0), HISTORY)
    damaged = d / disk_header.entry_name("m", _seq(2))
    damaged.write_bytes(b"\0" * 40)
    abandoned = d / f"{path.name}.tmp-{_dead_pid()}-0a1b2c3d"
    abandoned.write_bytes(b"x")
    (d / "notes.txt").write_text("mine")
    os.utime(path, (1_000_000_000, 1_000_000_000))  # the oldest: listed first
    before = _tree_state(d)
    d.chmod(0o555)  # and, when not root, no write could succeed anyway
    try:
        with caplog.at_level(logging.WARNING, LOGGER):
            listing = DiskCache.listing(d)
    finally:
        d.chmod(0o755)
    assert _tree_state(d) == before, "listing changed the directory"
    assert not _warnings(caplog)
    assert listing.exists and listing.directory == str(d)
    assert [(e.name, e.model_key, e.tokens) for e in listing.entries] == [
        (path.name, key, 64),
        (disk_header.entry_name("another-model", _seq(1)), "another-model", 32),
    ]
    assert listing.entries[0].idle_s > 1e8 and listing.entries[0].trimmable
    assert (
        sum(e.nbytes for e in listing.entries)
        == path.stat().st_size + before[listing.entries[1].name][0]
    )
    bad = {b.name: b for b in listing.bad}
    assert set(bad) == {damaged.name, abandoned.name}
    assert "header length" in bad[damaged.name].reason and bad[damaged.name].nbytes == 40
    assert "unfinished write" in bad[abandoned.name].reason
    # What the listing calls bad is what the next scan removes.
    disk = DiskCache(d)
    assert disk.stats().removed == 2 and not damaged.exists() and not abandoned.exists()
    assert [e.name for e in disk.entries()] == [e.name for e in listing.entries]


def test_listing_of_a_missing_directory_creates_nothing(tmp_path: Path):
    missing = tmp_path / "not" / "here"
    listing = DiskCache.listing(missing)
    assert not listing.exists and listing.entries == [] and listing.bad == []
    assert not (tmp_path / "not").exists()
    (tmp_path / "file").write_text("x")
    assert not DiskCache.listing(tmp_path / "file").exists
