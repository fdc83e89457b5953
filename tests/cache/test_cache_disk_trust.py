"""The disk cache is this user's alone: a 0700 folder of 0600 files, and a file or folder
another user could have written is skipped with a warning, never served (nor deleted)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from test_cache_disk import HISTORY, LOGGER, _kv_snapshot, _seq, _warnings

from mlx_prefix.cache.disk import header as disk_header
from mlx_prefix.cache.disk.tier import DiskCache


def _align(tokens):
    return lambda n: n


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _saved(d: Path) -> tuple[DiskCache, list[int], Path]:
    disk = DiskCache(d)
    tokens = _seq(1)
    assert disk.save("m", tokens, _kv_snapshot(32, 0), HISTORY)
    return disk, tokens, d / disk_header.entry_name("m", tuple(tokens))


def _request(tokens: list[int]) -> list[int]:
    return tokens + [7]


def test_the_folder_is_0700_and_files_0600_whatever_the_umask(tmp_path: Path):
    old = os.umask(0)
    try:
        _, _, path = _saved(tmp_path / "deep" / "cache")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "deep" / "cache") == 0o700
    assert _mode(path) == 0o600


def test_an_older_open_folder_of_ours_is_made_private(tmp_path: Path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    DiskCache(d)
    assert _mode(d) == 0o700


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666], ids=["group", "others", "both"])
def test_a_file_others_could_write_is_skipped_not_served_not_deleted(tmp_path, caplog, mode):
    _, tokens, path = _saved(tmp_path)
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, LOGGER):
        disk = DiskCache(tmp_path)
    assert any("never served" in m and path.name in m for m in _warnings(caplog))
    req = _request(tokens)
    assert disk.match("m", req, _align(req)) is None and disk.stats().files == 0
    assert path.exists()


def test_a_file_made_writable_after_the_scan_is_not_served(tmp_path, caplog):
    disk, tokens, path = _saved(tmp_path)
    disk = DiskCache(tmp_path)
    req = _request(tokens)
    match = disk.match("m", req, _align(req))
    assert match is not None
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert disk.load(match) is None
    assert any("writable by other users" in m for m in _warnings(caplog))
    assert path.exists() and disk.match("m", req, _align(req)) is None
    assert disk.stats().hits == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_another_users_file_is_skipped(tmp_path, caplog):
    _, tokens, path = _saved(tmp_path)
    os.chown(path, 12345, 12345)
    with caplog.at_level(logging.WARNING, LOGGER):
        disk = DiskCache(tmp_path)
    assert any("owned by uid 12345" in m for m in _warnings(caplog))
    assert disk.stats().files == 0 and path.exists()


def test_another_users_folder_is_neither_read_nor_written(tmp_path, caplog, monkeypatch):
    _, tokens, path = _saved(tmp_path)
    stranger = os.getuid() + 4242
    monkeypatch.setattr(os, "getuid", lambda: stranger)
    with caplog.at_level(logging.WARNING, LOGGER):
        disk = DiskCache(tmp_path)
        assert disk.stats().files == 0
        assert not disk.save("m", _seq(2), _kv_snapshot(32, 1), HISTORY)
    warnings = _warnings(caplog)
    assert any("nothing read from it" in m and "owned by uid" in m for m in warnings), warnings
    assert any("not saved" in m for m in warnings), warnings
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
