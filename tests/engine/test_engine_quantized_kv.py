"""Quantized KV cache (--kv-bits, --kv-group-size, --quantized-kv-start;
engine/forward/kv_quant.py):
a cache hit gives a cold run's tokens and logprobs bit for bit, on either side of the
quantization start, in memory and from disk; float and quantized entries never mix;
entries count their packed bytes."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache
from support.engine_helpers import EXACT, chat, run
from support.models import TEST_CACHE

from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cli import build_parser
from mlx_prefix.cli.args import engine_config
from mlx_prefix.config import DiskConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.forward.kv_quant import KvQuant
from mlx_prefix.engine.sharded.distributed import DistributedEngine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import CachePreference

HEAD = 32  # the tiny models' heads widened: quantization groups are at least 32 wide
SYSTEM = "You are the front desk of a hotel. Answer guests kindly and in one sentence. " * 4
_loaded: dict = {}


def model(kind: str):
    if kind not in _loaded:
        _loaded[kind] = load_model(str(cached_test_model(kind, head_dim=HEAD)))
    return _loaded[kind]


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(kind="dense", bits=8, start=0, disk=None, store=None, cache=TEST_CACHE):
        config = EngineConfig(kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
        engine = Engine(model(kind), cache, config, store=store, disk_config=disk)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def ask(question: str):
    return chat(("system", SYSTEM), ("user", question))


def system_end(engine: Engine) -> int:
    prompt = engine.plan(ask("Where is the pool?"))
    return max(c.position for c in prompt.checkpoints if c.kind.name == "SYSTEM")


def hit_equals_cold(engine: Engine, prompt, least: int):
    """Serve `prompt` from the cache (at least `least` tokens restored) and cold."""
    warm = run(engine, prompt, sampling=EXACT)
    cold = run(engine, prompt, cache=False, sampling=EXACT)
    assert warm.usage.cached_tokens >= least, warm.usage
    assert cold.usage.cached_tokens == 0
    assert warm.tokens == cold.tokens, "a cache hit changed the answer"
    assert warm.logprobs == cold.logprobs, "a cache hit changed the numbers"
    return warm


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
@pytest.mark.parametrize("bits", [8, 4])
def test_hit_equals_cold_and_quantization_changes_the_numbers(engines, kind, bits):
    engine = engines(kind, bits, start=64)
    first = run(engine, ask("Is breakfast included?"), sampling=EXACT)
    assert first.usage.prompt_tokens > 64
    warm = hit_equals_cold(engine, ask("Is breakfast included?"), first.usage.prompt_tokens - 3)
    # The same request another engine serves with float KV: other numbers, so the
    # quantization really ran on both the cold and the warm path.
    float_run = run(engines(kind, None), ask("Is breakfast included?"), sampling=EXACT)
    assert float_run.logprobs != warm.logprobs
    # Another question restores the system prompt (past the start: quantized state).
    hit_equals_cold(engine, ask("Where is the pool?"), system_end(engine))


NOTES = "Read these notes, then answer. " + " ".join(
    f"Room {i} faces the {w} side." for i, w in enumerate(["north", "south", "east"] * 9)
)


def notes(question: str):
    return chat(("user", NOTES + "\n\n" + question))


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
@pytest.mark.parametrize("where", ["prefill_crosses_start", "decode_crosses_start"])
def test_a_restore_below_the_start_quantizes_where_a_cold_run_does(engines, kind, where):
    probe = engines(kind, None)
    prompt = notes("Is breakfast included?")
    tokens = probe.plan(prompt).tokens
    other = probe.plan(notes("Where is the pool?")).tokens
    shared = next(i for i, (a, b) in enumerate(zip(tokens, other, strict=False)) if a != b)
    # The last periodic checkpoint before the prompts part: its state is float (below the
    # start) although the prefill that stored it went on past the start.
    periodic = [c.position for c in probe.plan(prompt).checkpoints if c.kind.name == "PERIODIC"]
    below = max(p for p in periodic if p < shared)
    start = below + 5 if where == "prefill_crosses_start" else len(tokens) + 3
    assert start < len(tokens) or where == "decode_crosses_start"
    engine = engines(kind, 4, start=start)
    run(engine, notes("Where is the pool?"))
    warm = hit_equals_cold(engine, prompt, below)
    snapshot = engine.store.get(_key_of(engine), tokens[:below])
    if where == "prefill_crosses_start":
        assert warm.usage.cached_tokens == below
        assert snapshot is not None
    if snapshot is not None:  # float KV, the state a cold run has there
        assert not any(layer.cls is QuantizedKVCache for layer in snapshot.layers)
        assert snapshot.trimmable == (kind == "dense")


def _key_of(engine: Engine) -> str:
    from mlx_prefix.engine.keys import entry_key

    return entry_key(engine.model_key, CachePreference())


def test_quantized_entries_restore_only_exactly(engines):
    engine = engines("dense", 8, start=0)
    run(engine, ask("Is breakfast included?"))
    infos = [e for e in engine.store.entries() if e.model_key == _key_of(engine)]
    assert infos and not any(e.trimmable for e in infos)
    snapshot = engine.store.get(_key_of(engine), engine.plan(ask("Is breakfast included?")).tokens)
    kinds = {layer.cls for layer in snapshot.layers}
    assert kinds == {QuantizedKVCache}


def test_hybrid_recurrent_state_stays_float_and_sliding_layers_stay_float(engines):
    engine = engines("qwen3_5", 8, start=0)
    prompt = ask("Is breakfast included?")
    run(engine, prompt)
    snapshot = engine.store.get(_key_of(engine), engine.plan(prompt).tokens)
    assert [layer.cls for layer in snapshot.layers] == [
        ArraysCache,
        QuantizedKVCache,
        ArraysCache,
        QuantizedKVCache,
    ]
    sliding = engines("sliding", 8, start=0)
    run(sliding, prompt)
    hit = hit_equals_cold(sliding, prompt, len(sliding.plan(prompt).tokens) - 3)
    assert hit.tokens
    snapshot = sliding.store.get(_key_of(sliding), sliding.plan(prompt).tokens)
    kinds = [layer.cls for layer in snapshot.layers]
    assert kinds == [RotatingKVCache, QuantizedKVCache, RotatingKVCache, QuantizedKVCache]


def test_concurrent_requests_run_one_at_a_time_and_equal_alone(engines):
    engine = engines("dense", 4, start=32)
    prompts = [ask(q) for q in ("Is breakfast included?", "Where is the pool?", "Any spa?")]
    alone = [run(engine, p, cache=False, sampling=EXACT) for p in prompts]
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = run(engine, prompts[i], sampling=EXACT)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, expected in zip(results, alone, strict=True):
        assert (got.tokens, got.logprobs) == (expected.tokens, expected.logprobs)
    assert engine.loop.capacity == 1 and engine.loop.decode.peak_batch == 1


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_restart_hits_the_disk_and_keys_do_not_mix(engines, tmp_path, kind):
    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    prompt = ask("Is breakfast included?")
    first = engines(kind, 4, start=48, disk=disk)
    run(first, prompt)
    first.shutdown()
    assert list(tmp_path.glob("*.safetensors"))

    other_bits = engines(kind, 8, start=48, disk=disk)
    assert run(other_bits, prompt).usage.cached_tokens == 0
    float_engine = engines(kind, None, disk=disk)
    assert run(float_engine, prompt).usage.cached_tokens == 0
    assert float_engine.views.cache_stats()["disk"]["hits"] == 0

    second = engines(kind, 4, start=48, disk=disk)
    hit_equals_cold(second, prompt, len(second.plan(prompt).tokens) - 3)
    assert second.views.cache_stats()["disk"]["hits"] == 1


def test_float_and_quantized_engines_sharing_a_store_never_hit_each_other(engines):
    store = PromptCache(1 << 30)
    prompt = ask("Is breakfast included?")
    float_engine = engines("dense", None, store=store)
    quantized = engines("dense", 8, start=0, store=store)
    assert float_engine.model_key != quantized.model_key
    run(float_engine, prompt)
    assert run(quantized, prompt).usage.cached_tokens == 0
    assert run(engines("dense", 4, start=0, store=store), prompt).usage.cached_tokens == 0
    assert run(float_engine, prompt).usage.cached_tokens > 0


def _bytes_per_token(engine: Engine, prompt) -> float:
    run(engine, prompt)
    tokens = engine.plan(prompt).tokens
    [entry] = [e for e in engine.store.entries() if e.tokens == len(tokens)]
    return entry.nbytes / entry.tokens


def test_entries_count_their_packed_bytes(engines):
    prompt = ask("Is breakfast included?")
    made = {bits: engines("dense", bits) for bits in (None, 8, 4)}
    per_token = {bits: _bytes_per_token(engine, prompt) for bits, engine in made.items()}
    # float32 keys of 32 values vs `bits` per value plus a float32 scale and bias per
    # group of 32 (both buffers padded to the same 256-token step).
    for bits in (8, 4):
        expected = (HEAD * 4) / (HEAD * bits / 8 + 2 * 4)
        assert per_token[None] / per_token[bits] == pytest.approx(expected, rel=0.01)
    # What /v1/cache reports: the store's resident bytes, lower by the same measure.
    resident = {bits: engine.views.cache_stats()["bytes"] for bits, engine in made.items()}
    assert resident[None] > resident[8] > resident[4] > 0


def test_the_default_start_is_mlx_lms():
    assert EngineConfig().quantized_kv_start == DEFAULT_QUANTIZED_KV_START
    assert KvQuant(8).start == DEFAULT_QUANTIZED_KV_START


@pytest.mark.parametrize(
    "argv",
    [
        ("--kv-bits", "7"),
        ("--kv-bits", "16"),
        ("--kv-group-size", "48"),
        ("--kv-group-size", "0"),
        ("--quantized-kv-start", "-1"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_bad_flag_values_are_one_line_usage_errors(capsys, command, argv):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, *argv] + (["hi"] if command == "generate" else []))
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mlx-prefix {command}: error: ") and argv[0] in line


def test_bad_env_values_and_unfit_models_are_refused_naming_the_flag(monkeypatch):
    args = build_parser().parse_args(["serve"])
    monkeypatch.setenv("MLX_PREFIX_ENGINE_KV_BITS", "7")
    with pytest.raises(ValueError, match="--kv-bits"):
        engine_config(args)
    monkeypatch.setenv("MLX_PREFIX_ENGINE_KV_BITS", "4")
    monkeypatch.setenv("MLX_PREFIX_ENGINE_KV_GROUP_SIZE", "128")
    config = engine_config(args)
    assert (config.kv_bits, config.kv_group_size) == (4, 128)
    with pytest.raises(ValueError, match="--kv-group-size 128 does not divide"):
        Engine(model("dense"), TEST_CACHE, config)
    with pytest.raises(ValueError, match="--kv-bits is not supported on a model sharded"):
        DistributedEngine(model("dense"), None, None, TEST_CACHE, EngineConfig(kv_bits=8))


def test_generate_takes_the_flags(tmp_path):
    path = str(cached_test_model("dense", head_dim=HEAD))
    argv = [sys.executable, "-m", "mlx_prefix", "generate", "--model", path, "-n", "4"]
    argv += ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    argv += ["--cache-dir", str(tmp_path), "--system", SYSTEM, "Hello"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    second = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    assert "cached_tokens=0 " in first.stderr
    assert "cached_tokens=0 " not in second.stderr  # the quantized system prompt, from disk
    assert second.stdout == first.stdout
    bad = subprocess.run(
        [*argv[:6], "--kv-bits", "4", "Hello"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1 and "--kv-group-size 64 does not divide" in bad.stderr


def test_the_server_reports_packed_bytes_and_answers_hits_as_cold_runs(engines):
    import httpx
    from support.server_fakes import serving

    engine = engines("dense", 4, start=32)
    body = {
        "model": "default",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
    }
    with serving(engine) as (url, _), httpx.Client(base_url=url, timeout=120) as http:
        first, warm = (http.post("/v1/chat/completions", json=body).json() for _ in range(2))
        cold = http.post(
            "/v1/chat/completions", json={**body, "prefix_cache": {"enabled": False}}
        ).json()
        cache = http.get("/v1/cache").json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 32
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    assert cache["stats"]["bytes"] == engine.views.cache_stats()["bytes"] > 0
    assert all(not e["trimmable"] for e in cache["entries"] if e["tokens"] > 32)
