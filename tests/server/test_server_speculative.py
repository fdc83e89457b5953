"""--draft-model / --num-draft-tokens and the draft_model / num_draft_tokens fields, as
mlx_lm.server has them: through the HTTP server and `mlx-prefix generate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.cli import build_parser
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.layer_skip import make_layer_skip_draft
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model

MESSAGES = [
    {"role": "system", "content": "You answer questions about the sea and its ships. " * 6},
    {"role": "user", "content": "Tell me about the lighthouse."},
]


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft") / "tiny-draft"
    return make_layer_skip_draft(cached_test_model("dense"), folder, 1)


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 16, "temperature": 0.0, **body}
    return httpx.post(url + "/v1/chat/completions", json=body | {"logprobs": True}, timeout=120)


def test_the_fields_are_honoured_with_the_servers_draft_and_a_foreign_one_is_a_400(
    draft_folder,
):
    # Plain decoding: prompt lookup (on by default) verifies in one forward, last bits apart.
    plain_engine = Engine(loaded_test_model("dense"), TEST_CACHE, EngineConfig(prompt_lookup=0))
    with serving(plain_engine) as (url, _):
        plain = _chat(url).json()
    draft = load_model(str(draft_folder))
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, draft=draft)
    with serving(engine) as (url, _):
        refused = _chat(url, draft_model="some/other-draft")
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "draft_model" and "some/other-draft" in error["message"]
        too_many = _chat(url, num_draft_tokens=1000)
        assert too_many.status_code == 400
        assert too_many.json()["error"]["param"] == "num_draft_tokens"

        named = _chat(url, draft_model="tiny-draft", num_draft_tokens=5)
        assert named.status_code == 200, named.text
        stats = engine.loop.decode.speculator.stats
        steps = stats.steps
        assert steps > 0 and stats.drafted > 3 * steps  # 5 asked, not 3
        off = _chat(url, num_draft_tokens=0).json()
        assert stats.steps == steps  # 0: plain decoding
        for reply in (named.json(), off):
            assert reply["choices"][0]["message"] == plain["choices"][0]["message"]
            assert reply["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]
        metrics = httpx.get(url + "/metrics").text
        assert f"mlx_prefix_speculative_drafted_total {float(stats.drafted)}" in (metrics)


def test_the_flags_parse_and_bound_the_count():
    args = build_parser().parse_args(["serve", "--draft-model", "d", "--num-draft-tokens", "5"])
    assert (args.draft_model, args.num_draft_tokens) == ("d", 5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--num-draft-tokens", "0", "hi"])


def test_generate_with_a_draft_prints_the_plain_reply(draft_folder, tmp_path):
    model = str(cached_test_model("dense"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_PREFIX_DISK_DIRECTORY": str(tmp_path)}

    def generate(*flags: str) -> dict:
        argv = [sys.executable, "-m", "mlx_prefix", "generate", "--model", model, "--json"]
        done = subprocess.run(
            [*argv, "-n", "12", *flags, "Tell me about the sea and its ships. " * 20],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    plain = generate()
    # Restored from the disk tier, whose entries carry no draft part: the draft is
    # prefilled over the prefix, and the reply is the plain one.
    spec = generate("--draft-model", str(draft_folder), "--num-draft-tokens", "2")
    assert spec["usage"]["cached_tokens"] > 0
    assert spec["text"] == plain["text"] and plain["text"]
    mismatch = subprocess.run(
        [sys.executable, "-m", "mlx_prefix", "generate", "--model",
         model, "--draft-model", str(draft_folder), "--prompt-lookup", "4", "hi"],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert mismatch.returncode != 0
    assert "one drafter at a time" in mismatch.stderr.strip().splitlines()[-1]
