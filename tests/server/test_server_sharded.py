"""`mlx-prefix serve` on 2 ranks over loopback with the ring backend
(tests/support/sharded_launch.py
starts them; skipped, with the reason, where mlx.launch cannot run here): the tiny dense
model in tensor mode, the tiny qwen3_5 hybrid in pipeline mode with a disk-tier restart,
a rank killed mid-request, and models that cannot be sharded refused at startup."""

from __future__ import annotations

import json
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.live import post_chat
from support.sharded_launch import launch_exits, launched

from mlx_prefix.models.testing import cached_test_model

SYSTEM = "You keep the harbour log: tides, winds and ships, in one short line each. " * 3


def ask(url: str, question: str, *, cache: bool = True, history: tuple = ()) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, *history]
    messages.append({"role": "user", "content": question})
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True}
    body["prefix_cache"] = {"enabled": cache}
    return post_chat(url, body)


def answer(reply: dict) -> tuple[str, list[float]]:
    choice = reply["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def tensor_group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded-tensor")
    # Batch-invariant, so requests answered together equal each alone (and the ranks'
    # startup calibration agrees); the hybrid tests below run the plain default.
    flags = ("--disk-cache", "off", "--deterministic")
    with launched(cached_test_model("dense"), tmp, *flags) as group:
        yield group


def test_the_startup_line_cache_and_metrics_show_the_group(tensor_group):
    assert "sharded over 2 ranks (ring, tensor parallel): rank 0 on" in tensor_group.text()
    stats = httpx.get(f"{tensor_group.url}/v1/cache", timeout=30).json()["stats"]
    group = stats["distributed"]
    assert (group["world_size"], group["backend"], group["mode"]) == (2, "ring", "tensor")
    assert [r["rank"] for r in group["ranks"]] == [0, 1]
    assert all(r["part"] == "1/2 of every layer's heads" for r in group["ranks"])
    metrics = httpx.get(f"{tensor_group.url}/metrics", timeout=30).text
    assert "mlx_prefix_distributed_world_size 2.0" in metrics
    assert 'mlx_prefix_distributed_rank_info{backend="ring"' in metrics


def test_multi_turn_reuses_the_cache_and_a_hit_answers_as_a_cold_run(tensor_group):
    url = tensor_group.url
    first = ask(url, "Which ships came in on the morning tide?")
    assert cached(first) == 0
    text, _ = answer(first)
    history = (
        {"role": "user", "content": "Which ships came in on the morning tide?"},
        {"role": "assistant", "content": text},
    )
    warm = ask(url, "And which left?", history=history)
    assert cached(warm) > 0, "the second turn restored nothing"
    cold = ask(url, "And which left?", history=history, cache=False)
    assert cached(cold) == 0
    assert answer(warm) == answer(cold), "a cache hit changed the answer or its logprobs"


def test_concurrent_requests_answer_as_each_alone(tensor_group):
    url = tensor_group.url
    questions = ["Any fog at dawn?", "Which berth is free?", "When is high water?"]
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: ask(url, q, cache=False), questions))
    for question, reply in zip(questions, together, strict=True):
        assert answer(reply) == answer(ask(url, question, cache=False))


def test_the_hybrid_in_tensor_mode_reuses_its_checkpoints_exactly(tmp_path):
    model = cached_test_model("qwen3_5")  # linear attention and KV layers, heads split
    with launched(model, tmp_path, "--disk-cache", "off") as group:
        first = ask(group.url, "Note the barometer at noon.")
        warm = ask(group.url, "Note the barometer at noon.")
        assert (cached(first), cached(warm) > 0) == (0, True)
        cold = ask(group.url, "Note the barometer at noon.", cache=False)
        assert answer(warm) == answer(cold) == answer(first)


def test_pipeline_mode_and_a_restart_served_from_each_ranks_disk(tmp_path):
    model = cached_test_model("qwen3_5")
    flags = ("--pipeline", "--disk-cache", "full", "--cache-dir", str(tmp_path / "disk"))
    question = "Log the evening: the wind backed south-west and the pilot boat went out."
    with launched(model, tmp_path, *flags) as group:
        assert "pipeline parallel): rank 0 on" in group.text()
        cold = ask(group.url, question)
        assert cached(cold) == 0
        assert None not in group.stop(), "the group did not stop on SIGTERM to rank 0"
    saved = {d.name: list(d.glob("*.safetensors")) for d in (tmp_path / "disk").iterdir()}
    assert sorted(saved) == ["rank0-of-2", "rank1-of-2"]
    assert all(saved.values()), f"a rank saved nothing: {saved}"
    with launched(model, tmp_path, *flags) as group:
        warm = ask(group.url, question)
        assert cached(warm) > 0, "the restarted group did not read its disk tier"
        assert answer(warm) == answer(cold)
        disk = httpx.get(f"{group.url}/v1/cache", timeout=30).json()["stats"]["disk"]
        assert disk["hits"] == 1 and disk["directory"].endswith("rank0-of-2")


def test_a_rank_killed_mid_request_fails_the_request_and_rank_0_exits(tmp_path):
    with launched(cached_test_model("dense"), tmp_path, "--disk-cache", "off", by_hand=True) as g:
        ask(g.url, "Ready?")  # the engines have calibrated: the kill lands mid-request
        body = {"messages": [{"role": "user", "content": "Tell the whole story."}]}
        body |= {"max_tokens": 500, "stream": True}
        with httpx.stream("POST", f"{g.url}/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            chunks = (json.loads(line[6:]) for line in lines if line.startswith("data: {"))
            for _ in range(2):
                assert next(chunks)["choices"][0]["delta"].get("content") is not None
            os.kill(g.rank_pids[1], signal.SIGKILL)
            rest = "\n".join(lines)  # the stream ends rather than hang
        assert "a rank of the group is gone" in rest
        codes = g.wait(60)
        assert codes[0] == 1, f"rank 0 exited with {codes[0]}"
        log = g.text()
        assert "mlx-prefix: error: sharded engine stopped: a rank of the group is gone" in log


def test_models_that_cannot_be_sharded_are_refused_at_startup(tmp_path):
    nine_heads = tmp_path / "nine-heads"
    shutil.copytree(cached_test_model("dense"), nine_heads)
    config = json.loads((nine_heads / "config.json").read_text())
    config["num_attention_heads"] = 9  # as SmolLM2-135M: 9 heads, 3 KV heads
    (nine_heads / "config.json").write_text(json.dumps(config))
    code, out = launch_exits(nine_heads, tmp_path)
    assert code == 2
    assert "cannot be served sharded over 2 ranks in tensor mode: num_attention_heads=9" in out
    code, out = launch_exits(cached_test_model("dense"), tmp_path, "--pipeline")
    assert code == 2
    assert "mlx-lm's llama model has no pipeline mode" in out
