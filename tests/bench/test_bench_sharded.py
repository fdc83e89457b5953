"""Issue 16's benchmark: the harness starts a server as a 2-rank group under mlx.launch
(ring backend, loopback) and stops every rank of it (skipped, with the reason, where
mlx.launch cannot run 2 ranks here); the #16 goal rows and the RESULTS.md section, from
a made-up run with the same workloads on 1 and 2 ranks."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.sharded_launch import require_launcher

from benchmarks import goals
from benchmarks.client import Request, send
from benchmarks.harness import run_async
from benchmarks.report import sharded as report_sharded
from benchmarks.servers import OURS, PEER, ServerSpec, new_server
from benchmarks.servers_sharded import ShardedServer, group_members
from mlx_prefix.models.testing import cached_test_model


def _listening(port: int) -> bool:
    """Something listens on TCP `port` (any address, /proc/net/tcp{,6}). Whether the port
    can be bound is no test: any process's outgoing connection may take it meanwhile."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                return True
    return False


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_the_harness_starts_and_stops_a_2_rank_server(tmp_path: Path) -> None:
    require_launcher()
    spec = ServerSpec(OURS, cached_test_model("dense"), (), "ours", ranks=2)
    server = new_server(spec, tmp_path / "logs")
    assert isinstance(server, ShardedServer)
    server.start()
    try:
        pgid = server.proc.pid
        pids = server.rank_pids()
        stats = httpx.get(f"{server.url}/v1/cache", timeout=30).json()["stats"]
        group = stats["distributed"]
        assert (group["world_size"], group["backend"]) == (2, "ring")
        assert [r["pid"] for r in group["ranks"]] == pids  # rank 0 first, read from /proc
        assert server.pid == pids[0] != pgid  # rank 0, not the launcher
        assert set(pids) < set(group_members(pgid))  # the ranks are in the launcher's group
        # The workloads' client against the group: a second turn is served from the cache.
        system = "You keep the harbour log, one short line per ship. " * 4
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        first = run_async(lambda c: send(c, server.url, Request(messages=messages, max_tokens=3)))
        messages += [{"role": "assistant", "content": first.text}]
        messages += [{"role": "user", "content": "And now?"}]
        warm = run_async(lambda c: send(c, server.url, Request(messages=messages, max_tokens=3)))
        assert first.cached_tokens == 0 and warm.cached_tokens > 0
        ports = [server.port, server.ring_port, server.ring_port + 1]
    finally:
        server.stop()
    assert server.proc is None
    assert group_members(pgid) == []  # no rank, no launcher left
    assert all(_gone(pid) for pid in pids)  # not even in a group of its own
    assert not any(_listening(p) for p in ports)


def _res(efficiency: float, ttfts: list[float], wall: float, match: bool, **extra) -> dict:
    samples = [{"label": f"turn {i + 1}", "ttft_s": t, "prompt_tokens": 100,
                "cached_tokens": 0 if i == 0 else 80} for i, t in enumerate(ttfts)]  # fmt: skip
    reuse = {"efficiency": efficiency, "over_reported": 0, "background": 0}
    checks = [{"label": "turn 3", "match": match}]
    return {"samples": samples, "reuse": reuse, "wall_s": wall, "checks": checks,
            "checks_matched": int(match), "notes": [], "extra": extra}  # fmt: skip


def _run(name: str, model: str, ours: dict, peer: dict, skipped: str | None = None) -> dict:
    title = {"chat": "Multi-turn chat", "burst": "Parallel burst, shared instruction"}[name]
    return {"workload": name, "title": title, "model": model, "skipped": skipped,
            "servers": {} if skipped else {OURS: ours, PEER: peer}}  # fmt: skip


def _made_up_run() -> dict:
    chat_2 = _run("chat", "sharded-hybrid", _res(1.0, [2.0, 0.2, 0.4], 3.0, True),
                  _res(0.5, [2.1, 0.8, 1.0], 5.0, True))  # fmt: skip
    burst_2 = _run(
        "burst",
        "sharded-hybrid",
        _res(0.9, [1.0, 2.0], 6.0, True, cold_wall_s=3.0, warm_wall_s=1.0, unique_wall_s=2.0),
        _res(0.3, [1.0, 4.0], 12.0, False, cold_wall_s=6.0, warm_wall_s=3.0, unique_wall_s=3.0),
    )
    chat_1 = _run("chat", "hybrid", _res(0.99, [1.0, 0.1, 0.1], 1.0, True),
                  _res(0.5, [1.0, 0.5, 0.5], 2.0, True))  # fmt: skip
    models = {
        "hybrid": {"path": "/m/qwen", "ranks": 1},
        "sharded-hybrid": {"path": "/m/qwen", "ranks": 2},
        "sharded-dense": {"path": "/m/llama", "ranks": 2},
    }
    skipped = _run("chat", "sharded-dense", {}, {}, skipped="no mlx.launch")
    return {"models": models, "workloads": [chat_1, chat_2, burst_2, skipped]}


def test_sharded_rows_show_both_servers_on_2_ranks_side_by_side() -> None:
    doc = _made_up_run()
    rows = goals.evaluate(doc)
    mine = {(g.what, g.model): g for g in rows if g.model.startswith("sharded")}
    assert all(g.status == "(information)" for g in mine.values())
    reuse = mine["reuse efficiency, multi-turn chat, 2 ranks, mlx-prefix; mlx_lm.server",
                 "sharded-hybrid"]  # fmt: skip
    assert reuse.value == 1.0 and reuse.shown == "1.000; mlx_lm.server 0.500"
    ttft = mine["median TTFT (later turns), multi-turn chat, 2 ranks, mlx-prefix / mlx_lm.server",
                "sharded-hybrid"]  # fmt: skip
    assert ttft.value == pytest.approx(0.3 / 0.9)  # turn 1 is cold on both: left out
    wall = mine["wall time, parallel burst, 2 ranks, mlx-prefix / mlx_lm.server",
                "sharded-hybrid"]  # fmt: skip
    assert wall.value == 0.5 and "cold 3.0 / 6.0 s, warm 1.0 / 3.0 s" in wall.shown
    same = mine["warm answers equal to their cold runs, parallel burst, 2 ranks",
                "sharded-hybrid"]  # fmt: skip
    assert same.shown == "1/1 mlx-prefix; 0/1 mlx_lm.server"
    assert "skipped: no mlx.launch" in mine["multi-turn chat, 2 ranks", "sharded-dense"].shown
    # The other goals stay on the 1-rank runs.
    chat4 = [g.model for g in rows if g.workload == "chat" and g.what.endswith("multi-turn chat")]
    assert chat4 == ["hybrid"]


def test_the_sharded_section_puts_1_and_2_ranks_side_by_side() -> None:
    md = "\n".join(report_sharded.lines(_made_up_run()))
    assert "## Sharded serving (2 ranks)" in md and "mlx.launch -n 2 --backend ring" in md
    assert "| Multi-turn chat | sharded-hybrid | mlx-prefix | 2 | 3.0 | 2.00 | 0.30 |" in md
    assert "| Multi-turn chat | sharded-hybrid | mlx_lm.server | 2 | 5.0 |" in md
    # The same model folder on 1 rank, for scale; a skipped run says why.
    assert "| Multi-turn chat | hybrid | mlx-prefix | 1 | 1.0 |" in md
    assert "sharded-dense | - | - | skipped: no mlx.launch" in md
    assert "0/1 match" in md  # mlx_lm.server's warm burst differed from its cold run
    assert report_sharded.lines({"models": {}, "workloads": []}) == []
