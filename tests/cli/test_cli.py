"""`mlx-prefix generate` end to end, through the installed console script."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import pytest

from mlx_prefix.cli import build_parser
from mlx_prefix.models.testing import cached_test_model, make_test_model
from mlx_prefix.platform import device_name

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


def messages_after_startup(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("mlx-prefix: device=")]


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


def test_unloadable_model_is_one_line_and_exit_code_2(tmp_path):
    truncated = make_test_model("dense", tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    no_tokenizer = make_test_model("dense", tmp_path / "no-tokenizer")
    for path in no_tokenizer.glob("tokenizer*"):
        path.unlink()
    for folder in (truncated, no_tokenizer):
        result = cli("generate", "--model", str(folder), "hi")
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        [error] = messages_after_startup(result.stderr)
        assert error.startswith("mlx-prefix: error: ") and str(folder) in error


def _one_line_usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "--model", "unused", *argv, "hi"])
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize(
    "argv",
    [
        ("--temp", "-1"),
        ("--temp", "nan"),
        ("--top-p", "5"),
        ("--top-p", "-0.1"),
        ("--seed", "-1"),
        ("--seed", str(2**64)),
        ("--max-tokens", "0"),
        ("-n", "ten"),
    ],
)
def test_sampling_flags_out_of_range_are_one_line_errors(capsys, argv):
    line = _one_line_usage_error(capsys, *argv)
    assert line.startswith("mlx-prefix generate: error: ") and argv[0] in line


def test_sampling_flags_at_their_bounds_are_accepted():
    args = build_parser().parse_args(
        ["generate", "--temp", "2", "--top-p", "0", "--seed", str(2**64 - 1), "-n", "1", "hi"]
    )
    assert (args.temp, args.top_p, args.seed, args.max_tokens) == (2.0, 0.0, 2**64 - 1, 1)


def test_system_prompt_that_would_be_dropped_is_an_error(tmp_path):
    messages = tmp_path / "chat.json"
    messages.write_text(
        json.dumps([{"role": "system", "content": "A"}, {"role": "user", "content": "hi"}])
    )
    model = str(cached_test_model("dense"))
    result = cli("generate", "--model", model, "--messages", str(messages), "--system", "B")
    assert result.returncode == 1
    [error] = messages_after_startup(result.stderr)
    assert "--system" in error and "system message" in error
    raw = cli("generate", "--model", model, "--raw", "--system", "B", "Once upon")
    assert raw.returncode == 1
    [error] = messages_after_startup(raw.stderr)
    assert "--raw" in error and "--system" in error


def test_checkpoint_interval_zero_is_a_one_line_error():
    result = cli(
        "generate", "--model", str(cached_test_model("dense")), "--checkpoint-interval", "0", "hi"
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [error] = messages_after_startup(result.stderr)
    assert "checkpoint_interval" in error


def test_closed_stdout_ends_quietly():
    """`mlx-prefix generate ... | head -c1`: the reader leaves, no traceback."""
    model = str(cached_test_model("dense"))
    with subprocess.Popen(
        [*CLI, "generate", "--model", model, "-n", "2000", "--temp", "1", "--seed", "0", "hi"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ) as proc:
        assert proc.stdout.read(1)
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert "error" not in stderr


def _crashing_cli(*argv: str) -> subprocess.CompletedProcess:
    """The CLI with a command that fails in a way no handler expects."""
    code = (
        "import sys\n"
        "from mlx_prefix import cli\n"
        "def boom(args):\n"
        "    raise RuntimeError('unexpected\\nsecond line')\n"
        "cli.cmd_cache = boom\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )


def test_unexpected_error_is_one_line_with_a_traceback_only_when_verbose():
    quiet = _crashing_cli("cache", "ls")
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    [error] = messages_after_startup(quiet.stderr)
    assert error == "mlx-prefix: error: RuntimeError: unexpected second line"
    verbose = _crashing_cli("--verbose", "cache", "ls")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert verbose.stderr.splitlines()[-1] == error


def test_generate_streams_text_and_prints_one_stats_line():
    model = cached_test_model("dense")
    result = cli("generate", "--model", str(model), "-n", "8", "--system", "Be brief.", "Hello")
    assert result.returncode == 0, result.stderr
    s = stats(result.stderr)
    assert int(s["completion_tokens"]) == 8 and int(s["prompt_tokens"]) > 10
    assert s["cached_tokens"] == "0"
    assert "ttft" in s and "prefill" in s and "decode" in s
    assert result.stdout.strip()
    assert "blas=" in result.stderr and f"device={device_name()} " in result.stderr


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
    # `generate` persists every checkpoint (scope full): the restart reuses up to the
    # generation prompt.
    again = stats(second.stderr)
    assert int(again["cached_tokens"]) >= int(again["prompt_tokens"]) - 3
    assert second.stdout == first.stdout

    listing = cli("cache", "ls")
    assert listing.returncode == 0 and "tokens" in listing.stdout
    assert len(listing.stdout.strip().splitlines()) >= 2
    cleared = cli("cache", "clear")
    assert cleared.returncode == 0 and "removed" in cleared.stdout
    assert not list(disk_cache_dir.glob("*.safetensors"))
    third = cli("generate", "--model", model, "-n", "6", "--system", system, "First change")
    assert stats(third.stderr)["cached_tokens"] == "0"


def test_cache_ls_changes_nothing_on_disk(disk_cache_dir):
    missing = cli("cache", "ls")
    assert missing.returncode == 0 and "no such folder" in missing.stderr
    assert not disk_cache_dir.exists()  # listing did not create the folder
    disk_cache_dir.mkdir()
    bad = disk_cache_dir / ("0" * 64 + ".safetensors")
    bad.write_bytes(b"not a checkpoint")
    listing = cli("cache", "ls")
    assert listing.returncode == 0 and "bad: " in listing.stderr
    assert bad.exists()  # reported, not removed: only a server's startup scan removes it


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_serve_keeps_debug_logging(monkeypatch, verbose):
    # serve() sets the mlx_prefix logger's level from its settings; -v must reach them.
    from mlx_prefix.cli import main
    from mlx_prefix.server import app

    seen: dict[str, bool] = {}

    def run(server) -> None:  # instead of serving: look at the logging, then return
        seen["debug"] = logging.getLogger("mlx_prefix.engine").isEnabledFor(logging.DEBUG)

    monkeypatch.setattr(app._GracefulServer, "run", run)
    logger = logging.getLogger("mlx_prefix")
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)
    logging.getLogger().setLevel(logging.DEBUG)  # what basicConfig does outside pytest
    argv = ["serve", "--model", str(cached_test_model("dense")), "--port", "0"]
    # In a thread of its own: main() clears that thread's MLX streams on its way out.
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(["-v"] * verbose + argv)))
    thread.start()
    thread.join(120)
    assert codes == [0]
    assert seen["debug"] is verbose
