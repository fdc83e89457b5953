"""Which models can be sharded, decided before any weight is read (engine/sharded/load.py),
the ranks' cache layouts compared, and the watch connection that notices a dead rank
(watch.py). Collectives go through tests/support/group_fakes.py."""

from __future__ import annotations

import json
import shutil
import socket
import time

import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model
from support.group_fakes import LocalGroup, on_every_rank

from mlx_prefix.engine.sharded.load import check_equal_caches, shard_refusal
from mlx_prefix.engine.sharded.watch import PeerWatch
from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model


def refusal(kind: str, world: int, pipeline: bool, edit=None, tmp_path=None) -> str | None:
    path = cached_test_model(kind)
    if edit is not None:
        path = shutil.copytree(path, tmp_path / kind)
        edit(path)
    config = json.loads((path / "config.json").read_text())
    model, _ = mlx_lm_load_model(path, lazy=True, strict=False)
    return shard_refusal(config, model, world, pipeline, path)


def test_models_whose_heads_divide_shard_in_tensor_mode():
    assert refusal("dense", 2, pipeline=False) is None
    assert refusal("qwen3_5", 2, pipeline=False) is None
    assert refusal("qwen3_5", 2, pipeline=True) is None


def test_heads_the_world_size_does_not_divide_are_refused(tmp_path):
    def nine_heads(path):
        config = json.loads((path / "config.json").read_text())
        config["num_attention_heads"] = 9
        (path / "config.json").write_text(json.dumps(config))

    why = refusal("dense", 2, False, nine_heads, tmp_path)
    assert why == "num_attention_heads=9 is not divisible by 2"
    assert refusal("qwen3_5", 8, False) == "linear_num_key_heads=2 is not divisible by 8"


def test_pipeline_needs_the_models_pipeline_a_weight_index_and_enough_layers(tmp_path):
    assert "llama model has no pipeline mode" in refusal("dense", 2, True)
    assert refusal("qwen3_5", 8, True) == "4 layers cannot be split over 8 ranks"
    why = refusal(
        "qwen3_5", 2, True, lambda p: (p / "model.safetensors.index.json").unlink(), tmp_path
    )
    assert why.startswith("no model.safetensors.index.json in ")


def test_ranks_whose_caches_differ_are_refused_on_every_rank():
    models = [load_model(str(cached_test_model(k))) for k in ("dense", "qwen3_5")]
    group = LocalGroup(2)
    same = on_every_rank(group, lambda r: check_equal_caches(models[0], group.channel(r), "x"))
    assert same == [None, None]
    differ = on_every_rank(group, lambda r: check_equal_caches(models[r], group.channel(r), "x"))
    for error in differ:
        assert isinstance(error, ModelNotFound)
        assert "the ranks' prompt caches differ in layout" in error.message


def test_the_watch_reports_a_rank_whose_connection_closes(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    group = LocalGroup(2)
    watches = on_every_rank(group, lambda r: PeerWatch.connect(group.channel(r), "ring"))
    assert sorted(watches[0].peers) == [1] and sorted(watches[1].peers) == [0]
    assert watches[0].peers[1].getsockname()[0] == "127.0.0.1"  # the hostfile's address
    lost = []
    watches[0].start(lost.append)
    watches[1].peers[0].shutdown(socket.SHUT_RDWR)  # as the kernel does for a dead rank
    watches[1].peers[0].close()
    deadline = time.monotonic() + 60  # a deadline for a watch that never sees it
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [1]
    watches[0].close()


@pytest.mark.parametrize("backend", ["mpi", "unknown"])
def test_the_watch_binds_every_interface_when_the_launcher_names_no_address(backend):
    group = LocalGroup(2)
    watches = on_every_rank(group, lambda r: PeerWatch.connect(group.channel(r), backend))
    assert all(isinstance(w, PeerWatch) and len(w.peers) == 1 for w in watches), watches
    for w in watches:
        w.close()
