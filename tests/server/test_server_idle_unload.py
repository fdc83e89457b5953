"""Idle unload (server/served/idle.py): a model idle past its keep-alive is unloaded and
the next request loads it again with the same answer; a pinned one, the --model one by
default, and one a request is using are not. The policy is checked on fakes with a clock
the test moves, handed to the pool (its `clock`; the unloader reads the pool's): never by
patching `time.monotonic`, which is asyncio's clock too; the live part on real tiny
models, polled with a deadline."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from support.live import post_chat
from support.pool_server import pool_server
from support.server_fakes import FakeEngine, FakeModel, wait_until

from mlx_prefix.config import FOREVER
from mlx_prefix.models.settings_file import parse_models_file
from mlx_prefix.models.testing import make_test_model
from mlx_prefix.server.served.idle import IdleUnloader
from mlx_prefix.server.served.names import ModelSpec
from mlx_prefix.server.served.pool import ModelPool
from mlx_prefix.server.served.status import model_statuses


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_pool(tmp_path: Path, settings: str = "", **kwargs) -> tuple[ModelPool, list[str]]:
    """A pool over fake engines that loads "b" and "c" (folders with a config.json)."""
    for name in ("b", "c"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text("{}")
    loaded: list[str] = []

    def loader(spec: ModelSpec, store, disk) -> FakeEngine:
        loaded.append(spec.id)
        return FakeEngine(FakeModel(name=spec.id))

    pool = ModelPool(
        FakeEngine(),
        loader=loader,
        max_models=3,
        allowed_models=[str(tmp_path / "b"), str(tmp_path / "c")],
        settings=parse_models_file(settings),
        memory=lambda: None,
        **kwargs,
    )
    return pool, loaded


def names(pool: ModelPool) -> list[str]:
    return [s.spec.id.rsplit("/", 1)[-1] for s in pool.slots()]


async def use(pool: ModelPool, name: str) -> None:
    _, lease = await pool.acquire(name)
    lease.release()


def test_keep_alive_policy_with_a_clock_the_test_moves(tmp_path):
    clock = Clock()
    c = str(tmp_path / "c")
    pinned = f'[models."{c}"]\npinned = true\n'
    pool, loaded = fake_pool(tmp_path, pinned, keep_alive_s=60, clock=clock)
    unloader = IdleUnloader(pool)

    async def scenario() -> None:
        await use(pool, str(tmp_path / "b"))
        await use(pool, c)
        assert names(pool) == ["fake-model", "b", "c"]
        assert [pool.keep_alive_for(s) for s in pool.slots()] == [FOREVER, 60, FOREVER]
        clock.now += 59
        assert await unloader.check() == []
        clock.now += 1
        assert await unloader.check() == [str(tmp_path / "b")]  # the default and the pin stay
        assert names(pool) == ["fake-model", "c"]
        clock.now += 10_000
        assert await unloader.check() == []
        # A request's keep_alive: 0 unloads at the next check (a pin still wins).
        await use(pool, str(tmp_path / "b"))
        assert pool.keep_alive(str(tmp_path / "b"), 0) and pool.keep_alive(c, 0)
        assert pool.keep_alive("default", 0)  # the --model one too, when told
        assert sorted(await unloader.check()) == sorted([str(tmp_path / "b"), "fake-model"])
        assert names(pool) == ["c"]
        # Unloaded models load again on their next request.
        await use(pool, "default")
        assert names(pool) == ["c", "fake-model"]

    asyncio.run(scenario())
    assert loaded == [str(tmp_path / "b"), c, str(tmp_path / "b"), "fake-model"]
    assert pool.unloads == 3  # b twice, the default once


def test_a_model_in_use_is_never_unloaded(tmp_path):
    clock = Clock()
    pool, _ = fake_pool(tmp_path, keep_alive_s=5, clock=clock)
    unloader = IdleUnloader(pool)
    b = str(tmp_path / "b")

    async def scenario() -> None:
        _, lease = await pool.acquire(b)  # a handler holds it
        clock.now += 100
        assert await unloader.check() == []
        lease.release()
        # asyncio's own clock still runs (a patched time.monotonic froze it: this slept
        # for ever), and /v1/ps reads the idle time off the pool's clock.
        await asyncio.wait_for(asyncio.sleep(0.01), timeout=60)
        clock.now += 4  # idle time counts from the last check that saw it in use
        [row] = [r for r in model_statuses(pool, unloader, {}) if r.id == b]
        assert row.idle_s == 4 and row.unloads_in_s == 1
        assert await unloader.check() == []
        clock.now += 1
        assert await unloader.check() == [b]

    asyncio.run(scenario())


def test_the_settings_file_keep_alive_and_server_defaults(tmp_path):
    b = str(tmp_path / "b")
    pool, _ = fake_pool(
        tmp_path,
        f'[models."{b}"]\nkeep_alive = "90s"\n[models.fake-model]\nkeep_alive = "1h"\n',
        keep_alive_s=300,
        default_keep_alive_s=FOREVER,
    )

    async def scenario() -> None:
        await use(pool, b)
        await use(pool, str(tmp_path / "c"))

    asyncio.run(scenario())
    assert [pool.keep_alive_for(s) for s in pool.slots()] == [3600, 90, 300]
    assert IdleUnloader(pool).poll_s() == 1.0  # at most once a second


# -- live: real tiny models -----------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {k: make_test_model("dense", root / f"tiny-{k}", seed=i) for i, k in enumerate("abc")}


def ask(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Opening hours?"}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    return post_chat(url, body)["choices"][0]["message"]["content"]


def loaded(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/ps").json()["models"]]


def test_unloaded_after_its_keep_alive_and_reloaded_with_the_same_answer(folders):
    b, c = str(folders["b"]), str(folders["c"])
    pinned = f'[models."{c}"]\npinned = true\n'
    allowed = (b, c)
    with pool_server(
        folders["a"],
        model_settings=parse_models_file(pinned),
        allowed_models=allowed,
        max_models=3,
        keep_alive_s=0.5,
    ) as (url, pool):
        first = ask(url, b)
        ask(url, c)
        assert wait_until(lambda: b not in loaded(url), timeout=120), loaded(url)
        assert loaded(url) == ["tiny-a", c]  # the pinned one and the --model one stay
        # /v1/ps stops listing it as its unload starts; the count moves at its end.
        assert wait_until(lambda: pool.unloads == 1, timeout=60)
        again = ask(url, b)
        ps = httpx.get(url + "/v1/ps").json()
    assert again == first
    assert pool.loads == 3
    # b may be gone again already (0.5 s idle: how soon depends on the machine); the
    # pinned one stays, with its weights counted. keep_alive_for's values: the fakes'.
    row = next(m for m in ps["models"] if m["id"] == c)
    assert row["pinned"] and row["keep_alive_s"] is None and row["weights_bytes"] > 0
