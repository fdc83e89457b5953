"""The default cache budget comes from the memory the weights leave (issue 55, item 3)."""

from __future__ import annotations

import argparse

from support.models import loaded_test_model

from mlx_prefix.cache.sizing import (
    FALLBACK_BUDGET,
    MIN_BUDGET,
    budget_for,
    default_budget,
    longest_conversation,
)
from mlx_prefix.cli.args import cache_args, cache_config
from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.parts import sized
from mlx_prefix.models.cost import kv_bytes_per_token

GiB = 1 << 30


def test_the_default_budget_is_a_share_of_what_the_weights_leave():
    assert default_budget(48 * GiB).nbytes == 24 * GiB  # a Mac's working set, after weights
    assert default_budget(None).nbytes == FALLBACK_BUDGET  # the device does not say
    assert default_budget(300 << 20).nbytes == MIN_BUDGET  # a floor...
    assert default_budget(100 << 20).nbytes == 100 << 20  # ...never above what is free


def test_a_budget_says_the_longest_conversation_it_keeps():
    qwen3_32b = 64 * 8 * 128 * 2 * 2  # 256 KiB of KV per token (issue 55)
    assert budget_for(20_000, qwen3_32b) == 20_000 * qwen3_32b * 5 // 4
    assert longest_conversation(budget_for(20_000, qwen3_32b), qwen3_32b) == 20_000
    line = default_budget(48 * GiB).describe(qwen3_32b)
    assert "24.00 GiB" in line and "48.0 GiB free" in line
    assert f"{longest_conversation(24 * GiB, qwen3_32b):,} tokens" in line
    assert "256 KiB of KV per token" in line


def test_the_model_kv_bytes_per_token():
    # The dense test model: 2 layers x 2 KV heads x 16 dims x (keys, values) x float32.
    assert kv_bytes_per_token(loaded_test_model("dense")) == 2 * 2 * 16 * 2 * 4
    # qwen3_5: two of its four layers are full attention; the linear ones add nothing.
    assert kv_bytes_per_token(loaded_test_model("qwen3_5")) == 2 * 2 * 16 * 2 * 4


def test_an_engine_sizes_its_budget_from_the_memory_free_after_its_weights(capsys):
    model = loaded_test_model("dense")
    asked = CacheConfig(budget_from_machine=True)
    config = sized(asked, model, None, free=lambda: 10 * GiB)
    assert (config.budget_bytes, config.budget_from_machine) == (5 * GiB, False)
    assert "keeps a conversation of up to" in capsys.readouterr().err
    assert sized(CacheConfig(budget_bytes=123), model, None, free=lambda: GiB).budget_bytes == 123


def test_the_flag_still_sets_the_budget(monkeypatch):
    monkeypatch.delenv("MLX_PREFIX_CACHE_BUDGET_BYTES", raising=False)
    parser = argparse.ArgumentParser()
    cache_args(parser)
    assert cache_config(parser.parse_args([])).budget_from_machine
    flagged = cache_config(parser.parse_args(["--cache-budget", "200000000"]))
    assert (flagged.budget_bytes, flagged.budget_from_machine) == (200_000_000, False)
    monkeypatch.setenv("MLX_PREFIX_CACHE_BUDGET_BYTES", "1GiB")
    assert not cache_config(parser.parse_args([])).budget_from_machine
