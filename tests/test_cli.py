"""`mlx-prefix generate` end to end, through the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlx_prefix.models.testing import cached_test_model

CLI = [sys.executable, "-m", "mlx_prefix"]


@pytest.fixture(autouse=True)
def disk_cache_dir(tmp_path, monkeypatch):
    """Keep the disk tier of every CLI run in this test's own folder."""
    directory = tmp_path / "prompt-cache"
    monkeypatch.setenv("MLX_PREFIX_DISK_DIRECTORY", str(directory))
    return directory


def cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


def stats(stderr: str) -> dict[str, str]:
    line = next(line for line in stderr.splitlines() if line.startswith("prompt_tokens="))
    return dict(field.split("=", 1) for field in line.split())


def test_missing_model_is_one_line_and_exit_code_2(tmp_path):
    for missing in (str(tmp_path / "nope"), "nobody/no-such-model-xyz"):
        result = cli("generate", "--model", missing, "hi")
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and missing in errors[0]


def test_generate_streams_text_and_prints_one_stats_line():
    model = cached_test_model("dense")
    result = cli("generate", "--model", str(model), "-n", "8", "--system", "Be brief.", "Hello")
    assert result.returncode == 0, result.stderr
    s = stats(result.stderr)
    assert int(s["completion_tokens"]) == 8 and int(s["prompt_tokens"]) > 10
    assert s["cached_tokens"] == "0"
    assert "ttft" in s and "prefill" in s and "decode" in s
    assert result.stdout.strip()
    assert "blas=" in result.stderr and "device=cpu" in result.stderr


def test_messages_file_and_json_output(tmp_path):
    model = cached_test_model("qwen3_5")
    messages = tmp_path / "chat.json"
    messages.write_text(
        json.dumps(
            [
                {"role": "system", "content": "You are a poet."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "A haiku, "},
                        {"type": "text", "text": "please."},
                    ],
                },
            ]
        )
    )
    result = cli(
        "generate", "--model", str(model), "--messages", str(messages), "-n", "4", "--json"
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["usage"]["completion_tokens"] == 4 and out["finish_reason"] == "length"


def test_bad_messages_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = cli("generate", "--model", str(cached_test_model("dense")), "--messages", str(bad))
    assert result.returncode == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_default_model_answers_paris():
    result = cli("generate", "--max-tokens", "16", "What is the capital of France?", timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_second_generate_with_the_same_system_prompt_reuses_the_disk_cache(disk_cache_dir):
    model = str(cached_test_model("qwen3_5"))
    system = "You write release notes for a small open-source tool, plainly. " * 6
    first = cli("generate", "--model", model, "-n", "6", "--system", system, "First change")
    second = cli("generate", "--model", model, "-n", "6", "--system", system, "First change")
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    assert stats(first.stderr)["cached_tokens"] == "0"
    assert int(stats(second.stderr)["cached_tokens"]) > 60
    assert second.stdout == first.stdout

    listing = cli("cache", "ls")
    assert listing.returncode == 0 and "tokens" in listing.stdout
    assert len(listing.stdout.strip().splitlines()) >= 2
    cleared = cli("cache", "clear")
    assert cleared.returncode == 0 and "removed" in cleared.stdout
    assert not list(disk_cache_dir.glob("*.safetensors"))
    third = cli("generate", "--model", model, "-n", "6", "--system", system, "First change")
    assert stats(third.stderr)["cached_tokens"] == "0"
