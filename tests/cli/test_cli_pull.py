"""`mlx-prefix pull` against a loopback stand-in for the Hugging Face Hub (HF_ENDPOINT):
the size said before the download, a dropped connection resumed with a Range request,
nothing fetched twice, HF_TOKEN sent, and one clear line for a repo that is missing or
not a model mlx-lm can load. `ls` lists the pulled model, and it serves with the network
refused: `pull` records the branch it pulled (refs/main) as huggingface-hub does, so the
offline cache lookups find the model by its bare repo id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.hub_standin import Repo, StandInHub
from support.served_process import StderrReader, serve_process

from mlx_prefix.models.resolve import find_local_model
from mlx_prefix.models.testing import cached_test_model

WEIGHTS = "model.safetensors"


def pull(hub: StandInHub, home: Path, *args: str, token: str | None = None):
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(home / "hf"),
        "MLX_PREFIX_HOME": str(home / "mlx-prefix"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_TOKEN", None)
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "mlx_prefix", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny() -> Repo:
    return Repo.from_folder(cached_test_model("dense"))


def snapshot(home: Path, repo: str, commit: str) -> Path:
    return home / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def test_pull_says_the_size_first_resumes_a_dropped_file_and_sends_the_token(tiny, tmp_path):
    size = len(tiny.files[WEIGHTS])
    assert size > 11 << 20  # past huggingface-hub's 10 MiB chunk: the drop leaves a part
    hub = StandInHub({"org/tiny": tiny}, drop_once={WEIGHTS: 11 << 20})
    with hub:
        done = pull(hub, tmp_path, "pull", "org/tiny", token="hf_secret")
    assert done.returncode == 0, done.stderr
    folder = snapshot(tmp_path, "org/tiny", tiny.commit)
    assert done.stdout.strip() == str(folder)
    total = sum(len(b) for b in tiny.files.values())
    first = done.stderr.index(f"org/tiny: {len(tiny.files)} files, {total / 2**20:.1f} MiB")
    assert first < done.stderr.index("Fetching")  # the size came before the download
    for name, data in tiny.files.items():
        assert (folder / name).read_bytes() == data, name
    # The weights came in two requests, the second resuming where the drop left off.
    ranges = [s.headers.get("range") for s in hub.gets(WEIGHTS)]
    assert ranges == [None, f"bytes={10 << 20}-"]
    assert all(s.headers.get("authorization") == "Bearer hf_secret" for s in hub.gets(WEIGHTS))


def test_a_second_pull_fetches_nothing_again_and_the_model_is_listed(tiny, tmp_path):
    hub = StandInHub({"org/tiny": tiny})
    with hub:
        assert pull(hub, tmp_path, "pull", "-q", "org/tiny").returncode == 0
        gets = len(hub.gets(WEIGHTS))
        again = pull(hub, tmp_path, "pull", "-q", f"org/tiny@{tiny.commit}")
        assert again.returncode == 0, again.stderr
        assert len(hub.gets(WEIGHTS)) == gets == 1
        assert "already here" in again.stderr
    listed = pull(hub, tmp_path, "ls", "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["name"], r["kind"], r["source"]) for r in rows] == [
        ("org/tiny", "dense", "hf-cache")
    ]
    assert rows[0]["path"] == str(snapshot(tmp_path, "org/tiny", tiny.commit))


def test_missing_repo_and_revision_are_one_line_each(tiny, tmp_path):
    with StandInHub({"org/tiny": tiny}) as hub:
        missing = pull(hub, tmp_path, "pull", "org/nope")
        revision = pull(hub, tmp_path, "pull", "org/tiny@v9")
        not_an_id = pull(hub, tmp_path, "pull", "tiny")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "mlx-prefix: error: model 'org/nope' could not be pulled: no such repo on the "
        "Hugging Face Hub (a private one needs HF_TOKEN)"
    )
    assert "no revision 'v9' in the repo" in revision.stderr and revision.returncode == 2
    assert "not a Hugging Face repo id" in not_an_id.stderr and not_an_id.returncode == 2
    assert not hub.gets(WEIGHTS)


@pytest.mark.parametrize(
    "change, why",
    [
        ("gguf", "no config.json (it holds GGUF files: llama.cpp's format)"),
        ("pytorch", "no model*.safetensors weights"),
        ("architecture", "mlx-lm has no 'no-such-arch' architecture"),
    ],
)
def test_a_repo_that_is_not_an_mlx_model_is_refused_before_its_weights(tiny, tmp_path, change, why):
    files = dict(tiny.files)
    if change == "gguf":
        files = {"model-Q4_K_M.gguf": b"GGUF" + bytes(100), "README.md": b"# a GGUF repo"}
    elif change == "pytorch":
        files["pytorch_model.bin"] = files.pop(WEIGHTS)
        del files["model.safetensors.index.json"]
    else:
        config = json.loads(files["config.json"])
        files["config.json"] = json.dumps({**config, "model_type": "no-such-arch"}).encode()
    with StandInHub({"org/other": Repo(commit="c" * 40, files=files)}) as hub:
        done = pull(hub, tmp_path, "pull", "org/other")
        fetched = [s.path for s in hub.seen if s.method == "GET" and "/resolve/" in s.path]
    assert done.returncode == 2
    [line] = [ln for ln in done.stderr.splitlines() if ln.startswith("mlx-prefix: error")]
    assert line.startswith("mlx-prefix: error: 'org/other' is not a model mlx-lm can load: ")
    assert why in line
    assert all(p.endswith("/config.json") for p in fetched)  # never the weights


def test_a_pulled_model_serves_with_the_network_refused(tiny, tmp_path, monkeypatch):
    with StandInHub({"org/tiny": tiny}) as hub:
        done = pull(hub, tmp_path, "pull", "-q", "org/tiny")
    assert done.returncode == 0, done.stderr
    cache = tmp_path / "hf" / "hub"
    folder = snapshot(tmp_path, "org/tiny", tiny.commit)
    assert (folder.parent.parent / "refs" / "main").read_text() == tiny.commit
    # The operator's lookups (--allowed-models, models.toml, launch) read the cache only.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    found = find_local_model("org/tiny")
    assert found is not None and found.path == folder
    # `serve --model org/tiny` offline, the stand-in gone: the pulled folder answers.
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": hub.url, "MLX_PREFIX_HOME": str(tmp_path / "mlx-prefix")}  # fmt: skip
    cmd = [sys.executable, "-m", "mlx_prefix", "serve", "--model", "org/tiny", "--port", "0",
           "--disk-cache", "off", "--no-prefetch"]  # fmt: skip
    with serve_process(cmd, env=env, stdout=subprocess.DEVNULL) as proc:
        err = StderrReader(proc)
        url = f"http://127.0.0.1:{err.port(timeout=300)}"
        body = {"model": "org/tiny", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        models = httpx.get(url + "/v1/models", timeout=30).json()
    assert r.status_code == 200, r.text + err.text()[-2000:]
    assert r.json()["usage"]["completion_tokens"] > 0
    assert models["data"][0]["id"] == "org/tiny"


def test_a_pull_of_a_branch_downloads_the_commit_it_checked(tiny, tmp_path):
    repo = Repo(tiny.commit, tiny.files, branches=("main", "dev"))
    with StandInHub({"org/tiny": repo}) as hub:
        done = pull(hub, tmp_path, "pull", "-q", "org/tiny@dev")
    assert done.returncode == 0, done.stderr
    # The branch was resolved once (the plan's look); every later request names the
    # commit, so what was checked is what came, even had the branch moved meanwhile.
    named = [s.path for s in hub.seen if "/dev" in s.path]
    assert named == ["/api/models/org/tiny/revision/dev"]
    assert all(f"/resolve/{tiny.commit}/" in s.path for s in hub.seen if "/resolve/" in s.path)
    refs = snapshot(tmp_path, "org/tiny", tiny.commit).parent.parent / "refs"
    assert (refs / "dev").read_text() == tiny.commit
