"""`mlx-prefix ls`, `rm` and `ps` on real folders and a real server: one line per model
(name, size, quantization, kind, context, tools/reasoning), `--json`; rm asks unless -y
and refuses what a running server serves; ps shows what the server has loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.hub_standin import Repo, StandInHub
from support.pool_server import pool_server

from mlx_prefix.models.testing import cached_test_model


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> dict[str, str]:
    """A home with four model folders and a hub cache with one pulled model."""
    root = tmp_path_factory.mktemp("machine")
    models = root / "home" / "models"
    models.mkdir(parents=True)
    for kind, think in (("dense", False), ("qwen3_5", True), ("sliding", False)):
        shutil.copytree(cached_test_model(kind, think), models / f"tiny-{kind}")
    quantized = models / "tiny-q4"
    shutil.copytree(cached_test_model("nemotron_h"), quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4}
    (quantized / "config.json").write_text(json.dumps(config))
    (models / ".tiny-dense.partial").mkdir()  # a conversion in progress: not listed
    env = {
        **os.environ,
        "MLX_PREFIX_HOME": str(root / "home"),
        "HF_HOME": str(root / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("MLX_PREFIX_URL", None)
    with StandInHub({"org/tiny": Repo.from_folder(cached_test_model("dense"))}) as hub:
        pulled = cli(env | {"HF_ENDPOINT": hub.url}, "pull", "-q", "org/tiny")
    assert pulled.returncode == 0, pulled.stderr
    return env


def cli(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_prefix", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ls_one_line_per_model_and_json(machine):
    text = cli(machine, "ls")
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line.split() for line in text.stdout.splitlines()}
    assert set(lines) == {"org/tiny", "tiny-dense", "tiny-qwen3_5", "tiny-sliding", "tiny-q4"}
    assert lines["tiny-qwen3_5"][3:] == ["float32", "hybrid", "ctx", "4,096", "tools,reasoning"]
    assert lines["tiny-sliding"][4] == "sliding" and lines["tiny-sliding"][-1] == "-"
    assert lines["tiny-q4"][3:5] == ["4-bit", "hybrid"]
    assert lines["org/tiny"][3:5] == ["float32", "dense"]
    rows = {r["name"]: r for r in map(json.loads, cli(machine, "ls", "--json").stdout.splitlines())}
    assert rows["org/tiny"]["source"] == "hf-cache" and rows["tiny-dense"]["source"] == "home"
    home = Path(machine["MLX_PREFIX_HOME"]) / "models"
    size = sum(p.stat().st_size for p in (home / "tiny-dense").iterdir())
    assert rows["tiny-dense"]["size_bytes"] == size
    assert rows["tiny-dense"]["context_length"] == 4096
    assert rows["tiny-qwen3_5"]["tools"] and rows["tiny-qwen3_5"]["reasoning"]


def test_rm_refuses_a_served_model_asks_without_y_and_deletes(machine):
    home = Path(machine["MLX_PREFIX_HOME"]) / "models"
    with pool_server(home / "tiny-sliding") as (url, _):
        refused = cli(machine, "rm", "-y", "tiny-sliding", "--url", url)
        no_tty = cli(machine, "rm", "tiny-dense", "--url", url, stdin="y\n")
        deleted = cli(machine, "rm", "-y", "org/tiny", "--url", url)
    assert refused.returncode == 1 and (home / "tiny-sliding").is_dir()
    assert f"tiny-sliding is served by the server at {url}" in refused.stderr
    assert no_tty.returncode == 1 and "pass -y" in no_tty.stderr and (home / "tiny-dense").is_dir()
    assert deleted.returncode == 0, deleted.stderr
    names = [json.loads(r)["name"] for r in cli(machine, "ls", "--json").stdout.splitlines()]
    assert "org/tiny" not in names and "tiny-dense" in names
    assert not list((Path(machine["HF_HOME"]) / "hub").glob("models--org--tiny/snapshots/*"))
    gone = cli(machine, "rm", "-y", "org/tiny")
    assert gone.returncode == 2 and "not found here" in gone.stderr


def test_ps_shows_what_the_server_has_loaded(machine, tmp_path):
    home = Path(machine["MLX_PREFIX_HOME"]) / "models"
    with pool_server(home / "tiny-qwen3_5", api_key="sesame") as (url, _):
        table = cli(machine, "ps", "--url", url, "--api-key", "sesame")
        as_json = cli(machine | {"MLX_PREFIX_SERVER_API_KEY": "sesame"}, "ps", "--json",
                      "--url", url)  # fmt: skip
        no_key = cli(machine, "ps", "--url", url)
    nobody = cli(machine, "ps", "--url", "http://127.0.0.1:9")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == ["NAME", "WEIGHTS", "CACHE", "RUNNING", "IDLE", "UNLOADS"]
    assert row.split()[0] == "tiny-qwen3_5" and row.endswith("stays (--model)")
    [model] = json.loads(as_json.stdout)["models"]
    assert model["folder"] == str(home / "tiny-qwen3_5") and model["weights_bytes"] > 0
    assert model["context_length"] == 4096 and model["unloads_in_s"] is None
    assert no_key.returncode == 1 and "HTTP 401" in no_key.stderr and "--api-key" in no_key.stderr
    assert nobody.returncode == 1 and "no server at http://127.0.0.1:9" in nobody.stderr
