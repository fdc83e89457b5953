"""DistributedEngine in one process: rank 0 and a follower, each on its own copy of a
tiny model, exchanging plans through tests/support/group_fakes.py. Every decision is rank 0's:
after any traffic the follower's cache holds exactly rank 0's entries, cancels and
cache actions reach it, a lost rank ends every request with one clear error (and a 503
for new ones), and ranks whose caches diverge stop rather than serve."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from support.engine_helpers import EXACT, chat, run, warm_equals_cold
from support.group_fakes import LocalGroup
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.cache.types import CheckpointKind
from mlx_prefix.config import DiskConfig, DiskScope
from mlx_prefix.engine.decode.constraints import ConstraintFactory
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.engine.sharded.distributed import DistributedEngine
from mlx_prefix.engine.sharded.plan import JobSpec, LatchedHandle, TurnPlan
from mlx_prefix.errors import Unavailable
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.request.plan import Checkpoint, RenderedPrompt
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    ResponseFormat,
    SamplingParams,
    TokenEvent,
)

SYSTEM = "You answer questions about the weather at sea, briefly and plainly. " * 4


@contextmanager
def ranks(kind: str = "dense", disk: DiskConfig | None = None, size: int = 2) -> Iterator[tuple]:
    group = LocalGroup(size)
    path = str(cached_test_model(kind))
    engines = [
        DistributedEngine(
            load_model(path), group.cluster(r), group.channel(r), TEST_CACHE, disk_config=disk
        )
        for r in range(size)
    ]
    try:
        yield group, engines
    finally:
        engines[0].shutdown(timeout=10)
        for e in engines[1:]:
            assert e.join(30), "a follower did not stop with rank 0"


def entries(engine: Engine) -> list[tuple]:
    return [(e.entry_id, e.tokens, e.kind.name, e.pinned) for e in engine.store.entries()]


def settled(engines: list[DistributedEngine]) -> None:
    """Wait for the followers to finish the turn rank 0 is idle after, then assert that
    every rank holds the same cache entries and took the same decode steps."""
    deadline = time.monotonic() + 20
    while True:
        views = [
            (entries(e), e.loop.decode.steps, e.disk.pending if e.disk else 0) for e in engines
        ]
        if all(v == views[0] for v in views) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for e, view in zip(engines, views, strict=True):
        assert view == views[0], f"rank {e.turns.cluster.rank} differs from rank 0"
        assert e.failure is None


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_the_follower_holds_rank_0s_entries_and_a_hit_answers_as_a_miss(kind):
    with ranks(kind) as (_, engines):
        lead = engines[0]
        first = chat(("system", SYSTEM), ("user", "Will it rain on the North Sea tomorrow?"))
        reply = run(lead, first)
        assert reply.usage.cached_tokens == 0
        second = chat(
            ("system", SYSTEM),
            ("user", "Will it rain on the North Sea tomorrow?"),
            ("assistant", reply.text),
            ("user", "And the day after?"),
        )
        warm = warm_equals_cold(lead, second)
        assert warm.usage.cached_tokens > 0
        # Sampled with temperature and no seed: rank 0 draws the seed, every rank follows;
        # held to JSON: every rank builds the grammar and advances it with the same tokens.
        run(lead, first, sampling=SamplingParams(max_tokens=6, temperature=0.9))
        json_reply = SamplingParams(max_tokens=8, response_format=ResponseFormat("json_object"))
        assert run(lead, first, sampling=json_reply).text.startswith("{")
        settled(engines)
        assert len(entries(lead)) >= 2


def test_cancels_and_cache_actions_reach_every_rank():
    with ranks() as (_, engines):
        lead = engines[0]
        long = chat(("system", SYSTEM), ("user", "Describe every sea you know."))
        handle = lead.submit(long, SamplingParams(max_tokens=200), CachePreference())
        events = handle.events(timeout=60)
        for _ in range(3):
            assert isinstance(next(events), TokenEvent)
        handle.cancel()
        last = [e for e in events][-1]
        assert isinstance(last, DoneEvent) and last.finish_reason == "cancelled"
        assert last.usage.completion_tokens < 200
        settled(engines)

        warmed = lead.warm(chat(("system", SYSTEM), ("user", "Fog?")), pin=True, timeout=60)
        assert warmed.pinned
        settled(engines)
        pinned = [e.entry_id for e in lead.store.entries() if e.pinned]
        assert pinned  # settled(): the follower's entries, pins included, are the same
        assert lead.views.set_pinned(pinned[0], False)
        settled(engines)
        assert lead.views.flush_cache() > 0
        settled(engines)
        assert entries(engines[1]) == []


def test_a_lost_rank_ends_requests_with_one_clear_error_and_new_ones_get_503():
    with ranks() as (group, engines):
        lead = engines[0]
        with serving(lead) as (url, _):
            body = {"messages": [{"role": "user", "content": "Tell me about tides."}]}
            body |= {"max_tokens": 3000, "stream": True}  # still going when the rank is lost
            with httpx.Client(base_url=url, timeout=60) as http:
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = r.iter_lines()
                    assert next(line for line in lines if line.startswith("data: "))
                    group.lose()
                    # The stream ends, it does not hang: SSE pings (every 15 s) keep a
                    # hung stream's reads alive, so the deadline is the test's own.
                    deadline, rest = time.monotonic() + 60, ""
                    for line in lines:
                        rest += line + "\n"
                        assert time.monotonic() < deadline, "the stream outlived its rank"
                assert "a rank of the group is gone" in rest
                new = http.post("/v1/chat/completions", json={**body, "stream": False})
                assert new.status_code == 503
                assert "restart the group" in new.json()["error"]["message"]
                assert http.get("/health").status_code == 503
        assert "a rank of the group is gone" in (lead.failure or "")
        assert engines[1].failure is not None
        with pytest.raises(Unavailable):
            lead.submit(chat(("user", "hi")), SamplingParams(max_tokens=2))


def test_a_job_in_the_plan_that_never_reached_the_ranks_ends_with_the_error():
    """The window the stream above hung in, 2 runs in 5: rank 0 had listed a new job in
    its turn's plan, and the exchange that would have sent it failed, so the job was in
    no phase of any engine when the group failed."""
    with ranks() as (group, engines):
        lead = engines[0]
        group.lose_at_next_job()
        handle = lead.submit(chat(("user", "Tell me about tides.")), SamplingParams(max_tokens=8))
        events = list(handle.events(timeout=30))  # a deadline for a hang
        assert len(events) == 1 and isinstance(events[0], ErrorEvent)
        assert "a rank of the group is gone" in events[0].message
        assert lead.lifecycle.pending == 0


def test_ranks_whose_caches_diverge_stop_instead_of_serving():
    with ranks() as (_, engines):
        lead, follower = engines
        run(lead, chat(("system", SYSTEM), ("user", "Is the wind rising?")))
        settled(engines)
        follower.store.set_budget(0)  # the follower alone drops its entries
        handle = lead.submit(chat(("user", "Storm?")), SamplingParams(max_tokens=4))
        last = list(handle.events(timeout=60))[-1]
        assert isinstance(last, ErrorEvent)
        assert "the ranks' caches no longer agree" in last.message
        assert follower.join(30) and "no longer agree" in (follower.failure or "")


def test_each_rank_persists_its_own_shard_and_another_world_size_misses(tmp_path):
    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    prompt = chat(("system", SYSTEM), ("user", "What does a red sky at night mean?"))
    with ranks("qwen3_5", disk) as (_, engines):
        cold = run(engines[0], prompt, sampling=EXACT)
        settled(engines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-of-2", "rank1-of-2"]
    for rank_dir in tmp_path.iterdir():
        assert any(rank_dir.glob("*.safetensors")), f"{rank_dir.name} saved nothing"
    with ranks("qwen3_5", disk) as (_, engines):  # a restart of the same group
        warm = run(engines[0], prompt, sampling=EXACT)
        assert warm.usage.cached_tokens > 0
        assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)
        assert engines[1].views.cache_stats()["disk"]["hits"] == 1
        settled(engines)
    with ranks("qwen3_5", disk, size=3) as (_, engines):  # another world size
        assert run(engines[0], prompt).usage.cached_tokens == 0


def test_a_plan_carries_a_job_whole_and_a_cancel_is_latched_once():
    prompt = RenderedPrompt((5, 6, 7, 8), (Checkpoint(2, CheckpointKind.SYSTEM),), True)
    handle = LatchedHandle("req-1", 4)
    fmt = ResponseFormat("json_object")
    sampling = SamplingParams(max_tokens=3, temperature=0.5, seed=11, response_format=fmt)
    job = Job(
        handle,
        prompt,
        sampling,
        CachePreference(scope=DiskScope.parse("full")),
        "key/ns",
        0.0,
        pin=True,
    )
    plan = TurnPlan(1.5, 64, jobs=(JobSpec.of(job),), cancels=(3,), write_save=True)
    again = TurnPlan.decode(plan.encode())
    assert again == plan
    copy = again.jobs[0].job(2.0, ConstraintFactory(loaded_test_model("dense").tokenizer))
    assert (copy.tokens, copy.prompt.checkpoints, copy.prompt.is_chat) == (
        job.tokens, prompt.checkpoints, True
    )  # fmt: skip
    assert (copy.sampling, copy.cache_pref, copy.cache_key, copy.pin, copy.serial) == (
        sampling, job.cache_pref, "key/ns", True, job.serial
    )  # fmt: skip
    assert copy.constraint is not None  # the grammar, built on this rank
    assert copy.warm is None and copy.handle.request_id == "req-1"
    handle.cancel()
    assert not handle.cancelled.is_set(), "a caller's cancel only asks"
    assert handle.latch() and handle.cancelled.is_set() and not handle.latch()
