"""Gated-delta prefill as a chunked scan off Metal (models/linear_scan.py): the hybrid
test model's linear-attention layers take it for chunks of 64 tokens or more, it
computes the loop's recurrence (masks and a starting state included), its identity says
so (states of the loop are never restored into it), and a cache hit still computes what
a miss computes, bit for bit, with every chunk of the grid through the scan."""

from __future__ import annotations

import dataclasses
import sys

import mlx.core as mx
import pytest
from support.engine_helpers import chat, warm_equals_cold
from support.models import loaded_test_model

from mlx_prefix.config import CacheConfig
from mlx_prefix.models import linear_scan

pytestmark = pytest.mark.skipif(
    mx.metal.is_available(), reason="on Metal mlx-lm's fused kernel computes the rule"
)
mlx_lm_gated = pytest.importorskip("mlx_lm.models.gated_delta")
pytest.importorskip("mlx_vlm")

# Chunks of 128 (two scan blocks), checkpoints every 256: every full chunk is scanned.
SCANNED = CacheConfig(budget_bytes=1 << 30, prefill_chunk=128, checkpoint_interval=256)


def qwen3_5_update():
    import mlx_lm.models.qwen3_5 as qwen3_5

    return qwen3_5.gated_delta_update


def test_the_hybrid_model_prefills_by_the_scan_and_its_identity_says_so():
    model = loaded_test_model("qwen3_5")
    assert linear_scan.install()
    assert getattr(qwen3_5_update(), "chunked", False)
    assert model.identity.prefill_scan and linear_scan.uses_scan(model.model)
    loop_key = dataclasses.replace(model.identity, prefill_scan=False).key()
    assert model.identity.key() != loop_key  # the loop's states are another model's
    dense = loaded_test_model("dense")
    assert not dense.identity.prefill_scan and not linear_scan.uses_scan(dense.model)


@pytest.mark.parametrize("tokens", [64, 200])
def test_the_scan_computes_the_loops_recurrence(tokens):
    loaded_test_model("qwen3_5")  # installs the scan
    B, Hk, Hv, Dk, Dv = 2, 2, 4, 16, 16
    keys = mx.random.split(mx.random.key(7), 5)
    q = mx.random.normal((B, tokens, Hk, Dk), key=keys[0]) * 0.2
    k = mx.random.normal((B, tokens, Hk, Dk), key=keys[1]) * 0.2
    v = mx.random.normal((B, tokens, Hv, Dv), key=keys[2])
    a = mx.random.normal((B, tokens, Hv), key=keys[3])
    b = mx.random.normal((B, tokens, Hv), key=keys[4])
    A_log, dt_bias = mx.zeros((Hv,)) - 0.5, mx.zeros((Hv,))
    state = mx.random.normal((B, Hv, Dv, Dk), key=mx.random.key(9)) * 0.1
    mask = mx.arange(tokens)[None, :] >= mx.array([[0], [5]])  # row 1 left-padded by 5
    y_loop, s_loop = mlx_lm_gated.gated_delta_update(
        q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=False
    )
    y_scan, s_scan = qwen3_5_update()(q, k, v, a, b, A_log, dt_bias, state, mask)
    assert s_scan.dtype == s_loop.dtype
    rows = mask[..., None, None]  # padded positions' outputs are never read
    assert mx.allclose(mx.where(rows, y_scan, 0), mx.where(rows, y_loop, 0), atol=1e-4).item()
    assert mx.allclose(s_scan, s_loop, atol=1e-4).item()


@pytest.fixture
def scan_calls(monkeypatch):
    """The token counts of every call of mlx-vlm's chunked scan, the function the
    prefill's update runs (a spy wrapped around it, swapped in by a fresh `install`;
    the modules and the update are put back afterwards)."""
    import mlx_vlm.models.qwen3_5.gated_delta as vlm_gated

    loaded_test_model("qwen3_5")  # its modules are imported and the scan installed
    calls: list[int] = []
    scan = vlm_gated.gated_delta_chunked

    def spy(q, *args, **kwargs):
        calls.append(q.shape[1])
        return scan(q, *args, **kwargs)

    monkeypatch.setattr(vlm_gated, "gated_delta_chunked", spy)
    monkeypatch.setattr(linear_scan, "_chunked", None)  # built again, around the spy
    for name, module in list(sys.modules.items()):
        update = getattr(module, "gated_delta_update", None)
        if name.startswith("mlx_lm.models.") and getattr(update, "chunked", False):
            monkeypatch.setattr(module, "gated_delta_update", mlx_lm_gated.gated_delta_update)
    assert linear_scan.install()
    return calls


def test_a_hit_computes_what_a_miss_computes_with_the_scan(make_engine, scan_calls):
    engine = make_engine("qwen3_5", cache_config=SCANNED)
    system = ("system", "You answer from the river atlas. " * 60)
    first = chat(system, ("user", "Where does the river bend? " * 12))
    warm_equals_cold(engine, first)
    assert scan_calls, "no chunk went through the scan"
    assert all(n >= linear_scan.MIN_TOKENS for n in scan_calls)
    second = chat(system, ("user", "Where does the river bend? " * 12), ("assistant", "North."),
                  ("user", "And the lamp? " * 20))  # fmt: skip
    result = warm_equals_cold(engine, second)
    assert result.usage.cached_tokens >= 256  # restored at a checkpoint past scanned chunks
