"""The dashboard's data and endpoints: the tree (nest, text heads, memory + disk), the
recent-request ring, GET /v1/dashboard, pin/unpin and evict one entry, the page and
its files, and who may read and act (API key, origins, Host, content type)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from support.live import post_chat
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import FakeEngine, serving, wait_until

from mlx_prefix.cache.disk.index import DiskEntryInfo
from mlx_prefix.cache.types import StoredTokens
from mlx_prefix.config import DiskConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.records import CachePreference, PromptInput, SamplingParams, Usage
from mlx_prefix.server.app import serving_line
from mlx_prefix.server.guards.namespaces import Caller
from mlx_prefix.server.monitor.dashboard import HEAD_TOKENS, TreeShapes, nest, snapshot
from mlx_prefix.server.monitor.recent import RecentRequests
from mlx_prefix.server.protocol.messages import conversation_from_dicts

SYSTEM = {"role": "system", "content": "You are the help desk of a public library. " * 4}
KEY = "sesame"


def chat(c: httpx.Client, question: str, **extra) -> dict:
    body = {"messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 8}
    return post_chat(c, {**body, **extra})


def entries(c: httpx.Client) -> list[dict]:
    return c.get("/v1/dashboard").json()["tree"]


@pytest.fixture
def fake() -> Iterator[tuple[httpx.Client, FakeEngine]]:
    with serving() as (url, engine), httpx.Client(base_url=url, timeout=10) as c:
        yield c, engine


# -- the tree, pure ---------------------------------------------------------------------


def test_nest_finds_the_longest_stored_prefix_in_pre_order():
    seqs = {
        "sys": (1, 2, 3),
        "a": (1, 2, 3, 4, 5),
        "a2": (1, 2, 3, 4, 5, 6, 7),
        "b": (1, 2, 3, 9),
        "other": (7, 7),
        "near": (1, 2),  # a prefix of sys: sys hangs under it
    }
    parents = nest(seqs)
    assert parents == {
        "near": None,
        "sys": "near",
        "a": "sys",
        "a2": "a",
        "b": "sys",
        "other": None,
    }
    assert list(parents) == ["near", "sys", "a", "a2", "b", "other"]  # parents first
    assert nest({}) == {}
    assert nest({"x": (5, 1), "y": (5, 2)}) == {"x": None, "y": None}  # no stored prefix


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, tokens: list[int]) -> str:
        self.calls += 1
        return " ".join(map(str, tokens))


def test_tree_shapes_decode_only_what_each_node_adds_and_only_when_the_set_changes():
    tok = CountingTokenizer()
    shapes = TreeShapes()
    long = tuple(range(100))
    seqs = {"m1": long[:10], "m2": long}
    nodes = shapes.nodes(seqs, tok)
    assert [(n.node_id, n.parent, n.start, n.length) for n in nodes] == [
        ("m1", None, 0, 10),
        ("m2", "m1", 10, 100),
    ]
    assert nodes[1].head == " ".join(map(str, range(10, 10 + HEAD_TOKENS)))
    assert tok.calls == 2
    assert shapes.nodes(dict(seqs), tok) == nodes and tok.calls == 2  # same set: cached
    shapes.nodes({**seqs, "m3": long[:50]}, tok)
    assert tok.calls == 5  # a new entry: the tree is rebuilt


def _disk_info(name: str, tokens: tuple, nbytes: int = 777, key: str = "k") -> StoredTokens:
    info = DiskEntryInfo(name, key, "mlx-lm x", len(tokens), "HISTORY", True, nbytes, 3.0)
    return StoredTokens(info, tokens)


def test_snapshot_merges_memory_and_disk_nodes_by_their_tokens():
    engine = FakeEngine()
    prompt = PromptInput(
        messages=conversation_from_dicts([{"role": "user", "content": "alpha beta gamma"}])
    )
    engine.submit(prompt, SamplingParams(max_tokens=4))  # stores one entry
    (mem,) = engine.views.cache_sequences()
    key = mem.info.model_key  # files join and nest under memory entries of their own key
    on_both = _disk_info("f1", mem.tokens, 500, key)
    more = engine.model.tokenizer.ids(" delta", " epsilon")
    disk_only = _disk_info("f2", (*mem.tokens, *more), key=key)
    engine.views.disk_sequences = lambda: [on_both, disk_only]  # type: ignore[method-assign]
    body = snapshot(engine, RecentRequests(), TreeShapes(), Caller("", admin=True))
    root, child = body["tree"]
    assert root["id"] == f"m{mem.info.entry_id}" and root["disk_bytes"] == 500
    assert root["entry_id"] == mem.info.entry_id and root["kind"] == "LAST_MESSAGE"
    assert root["head"].startswith("<user> alpha beta gamma")
    assert child["id"] == "df2" and child["parent"] == root["id"]
    assert child["entry_id"] is None and child["bytes"] is None and child["disk_bytes"] == 777
    assert child["start"] == len(mem.tokens) and child["head"] == " delta epsilon"
    assert child["kind"] == "HISTORY" and child["pinned"] is False


def test_snapshot_nests_and_merges_only_inside_one_namespace():
    engine = FakeEngine()
    short, longer = PromptInput(text="alpha beta gamma"), PromptInput(text="alpha beta gamma delta")
    engine.submit(short, SamplingParams(max_tokens=4), CachePreference(namespace="a"))
    engine.submit(longer, SamplingParams(max_tokens=4), CachePreference(namespace="b"))
    (a,) = (s for s in engine.views.cache_sequences() if s.info.tokens == 3)
    (b,) = (s for s in engine.views.cache_sequences() if s.info.tokens == 4)
    # B's file of A's very tokens: its own node, and B's longer entry nests under it.
    b_file = _disk_info("fb", a.tokens, key=b.info.model_key)
    engine.views.disk_sequences = lambda: [b_file]  # type: ignore[method-assign]
    tree = snapshot(engine, RecentRequests(), TreeShapes(), Caller("", admin=True))["tree"]
    nodes = {n["id"]: n for n in tree}
    assert set(nodes) == {f"m{a.info.entry_id}", f"m{b.info.entry_id}", "dfb"}
    assert nodes[f"m{a.info.entry_id}"]["parent"] is None
    assert nodes[f"m{b.info.entry_id}"]["parent"] == "dfb"
    assert nodes["dfb"]["namespace"] == nodes[f"m{b.info.entry_id}"]["namespace"]


def test_recent_requests_keep_the_last_ones_in_order():
    ring = RecentRequests(size=3)
    usage = Usage(10, 2, 7, 0.05, 100.0, 20.0)
    for i in range(5):
        ring.add(f"r{i}", "/v1/chat/completions", "200", 12.0, 10, usage, "stop")
    ring.add("bad", "/v1/chat/completions", "400", 1.0, 0, None, None)
    records = ring.records()
    assert [r.request_id for r in records] == ["r3", "r4", "bad"]
    assert [r.seq for r in records] == [4, 5, 6]
    assert records[0].cached_tokens == 7 and records[0].ttft_s == 0.05
    assert records[0].total_s == pytest.approx(0.012)
    assert records[-1].cached_tokens is None and records[-1].status == "400"


def test_serving_line_names_the_dashboard():
    assert serving_line("m", "127.0.0.1", 8080) == (
        "serving m on http://127.0.0.1:8080 (dashboard: http://127.0.0.1:8080/dashboard)"
    )
    assert serving_line("m", "0.0.0.0", 9).endswith("(dashboard: http://127.0.0.1:9/dashboard)")
    assert serving_line("m", "::", 9).endswith("(dashboard: http://[::1]:9/dashboard)")
    assert "http://[::]:9 " in serving_line("m", "::", 9)


# -- endpoints, fake engine ------------------------------------------------------------


def test_the_page_its_files_and_the_redirect(fake):
    c, _ = fake
    # A browser (asking for HTML) is sent to the dashboard; other clients get Ollama's probe.
    r = c.get("/", headers={"Accept": "text/html"}, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/dashboard"
    page = c.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
    assert "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    for src in ("/dashboard/static/dashboard.js", "/dashboard/static/uplot/uPlot.iife.min.js"):
        assert src in page.text
        js = c.get(src)
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    for bad in ("nope.js", "uplot/LICENSE", "../routes/common.py", "%2e%2e/app.py"):
        assert c.get(f"/dashboard/static/{bad}").status_code == 404


def test_no_file_the_page_loads_comes_from_elsewhere(fake):
    c, _ = fake
    for path in ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/static/dashboard.css"):
        assert "://" not in c.get(path).text  # every URL it loads or calls is this server's


def test_data_shows_entries_hits_and_recent_requests(fake):
    c, _ = fake
    first = chat(c, "Where are the atlases?")
    assert entries(c)[0]["hits"] == 0
    second = chat(c, "Where are the atlases?")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    body = c.get("/v1/dashboard").json()
    assert body["model"] == "fake-model"
    (entry,) = body["tree"]
    assert entry["hits"] == 1 and "help desk" in entry["head"]
    assert entry["tokens"] == first["usage"]["prompt_tokens"]
    assert [r["cached_tokens"] for r in body["requests"]] == [
        0,
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
    ]
    assert body["memory"]["hits"] == 1 and body["memory"]["budget_bytes"] > 0
    assert body["activity"] == {"capacity": 8, "jobs": []}
    r = c.post("/v1/chat/completions", json={"messages": "no"})
    assert r.status_code == 400
    last = c.get("/v1/dashboard").json()["requests"][-1]
    assert last["status"] == "400" and last["cached_tokens"] is None


def test_pin_unpin_and_evict_one_entry(fake):
    c, engine = fake
    chat(c, "Where are the atlases?")
    chat(c, "Something else entirely")
    a, b = (e["entry_id"] for e in entries(c))
    r = c.post(f"/v1/cache/entries/{a}/pin", json={"pinned": True})
    assert r.status_code == 200 and r.json() == {"entry_id": a, "pinned": True}
    assert {e["entry_id"]: e["pinned"] for e in entries(c)} == {a: True, b: False}
    refused = c.delete(f"/v1/cache/entries/{a}")
    assert refused.status_code == 409 and "unpin it first" in refused.json()["error"]["message"]
    assert c.post(f"/v1/cache/entries/{a}/pin", json={"pinned": False}).status_code == 200
    assert c.delete(f"/v1/cache/entries/{a}").json() == {"entry_id": a, "evicted": True}
    assert [e["entry_id"] for e in entries(c)] == [b]
    gone = c.delete(f"/v1/cache/entries/{a}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "entry_not_found"
    assert c.post(f"/v1/cache/entries/{a}/pin", json={"pinned": True}).status_code == 404
    assert c.delete("/v1/cache/entries/abc").status_code == 404  # not an id: no route


@pytest.mark.parametrize(
    "body", [{}, {"pinned": "yes"}, {"pinned": 1}, {"pinned": True, "extra": 1}, []]
)
def test_pin_refuses_a_body_it_does_not_understand(fake, body):
    c, _ = fake
    chat(c, "Where are the atlases?")
    (entry,) = entries(c)
    r = c.post(f"/v1/cache/entries/{entry['entry_id']}/pin", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] in ("pinned", None)
    assert entries(c)[0]["pinned"] is False


def test_the_api_key_guards_the_data_and_the_actions_not_the_page():
    with serving(api_key=KEY) as (url, _), httpx.Client(base_url=url) as c:
        assert c.get("/dashboard").status_code == 200
        assert c.get("/dashboard/static/dashboard.js").status_code == 200
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/dashboard").status_code == 401
        assert c.get("/v1/dashboard", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/dashboard", headers=auth).status_code == 200
        body = {"messages": [SYSTEM, {"role": "user", "content": "hi"}]}
        assert c.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
        entry_id = c.get("/v1/dashboard", headers=auth).json()["tree"][0]["entry_id"]
        assert c.post(f"/v1/cache/entries/{entry_id}/pin", json={"pinned": True}).status_code == 401
        assert c.delete(f"/v1/cache/entries/{entry_id}").status_code == 401
        assert c.delete("/v1/cache").status_code == 401
        (entry,) = c.get("/v1/dashboard", headers=auth).json()["tree"]
        assert entry["pinned"] is False  # nothing happened


def test_a_foreign_origin_can_neither_read_nor_act(fake):
    c, _ = fake
    local = {"Origin": "http://localhost:3000"}
    r = c.post("/v1/chat/completions", json={"messages": [SYSTEM], "max_tokens": 4}, headers=local)
    assert r.status_code == 200  # the allowed page's own entry: the one it may act on
    (entry,) = entries(c)
    pin = f"/v1/cache/entries/{entry['entry_id']}/pin"
    evil = {"Origin": "https://evil.example"}
    assert c.get("/v1/dashboard", headers=evil).status_code == 403
    for content_type in ("text/plain", "application/json"):  # a simple request, or not
        r = c.post(pin, content=b'{"pinned": true}', headers={**evil, "Content-Type": content_type})
        assert r.status_code == 403
    assert c.delete(f"/v1/cache/entries/{entry['entry_id']}", headers=evil).status_code == 403
    assert c.delete("/v1/cache", headers=evil).status_code == 403
    # an allowed page must still label its body JSON: a form post cannot act
    form = c.post(pin, content=b'{"pinned": true}', headers={**local, "Content-Type": "text/plain"})
    assert form.status_code == 415
    assert entries(c)[0]["pinned"] is False and len(entries(c)) == 1  # nothing happened
    ok = c.post(pin, json={"pinned": True}, headers=local)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == local["Origin"]


def test_the_data_is_refused_to_a_host_name_the_host_policy_refuses(fake):
    # DNS rebinding: a hostile name re-pointed at 127.0.0.1 makes its page "same origin";
    # its GETs carry no Origin, only its own Host. The check is the server's own now
    # (middleware.HostGuard, every route: test_server_hosts.py), hence its code.
    c, _ = fake
    port = c.base_url.port
    chat(c, "Where are the atlases?")
    for host in (f"evil.example:{port}", "evil.example", f"localhost.evil.example:{port}"):
        r = c.get("/v1/dashboard", headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert c.get("/v1/dashboard", headers={"Host": host}).status_code == 200
    with serving(allowed_origins=("http://lab.example:8080",)) as (url, _):
        r = httpx.get(url + "/v1/dashboard", headers={"Host": "lab.example:8080"})
        assert r.status_code == 200


# -- the real engine ---------------------------------------------------------------------


@pytest.fixture
def real(tmp_path) -> Iterator[tuple[httpx.Client, Engine]]:
    disk = DiskConfig(scope="full", directory=str(tmp_path))
    config = EngineConfig(prefetch_next_turn=False)
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, config, disk_config=disk)
    with serving(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        yield c, engine


def test_real_engine_tree_text_hits_pin_and_evict(real):
    c, engine = real
    cold = chat(c, "Where are the atlases?", prefix_cache={"enabled": False})
    first = chat(c, "Where are the atlases?")
    tree = entries(c)
    assert tree, "the request stored checkpoints"
    roots = [n for n in tree if n["parent"] is None]
    assert roots and "help desk of a public library" in roots[0]["head"]
    deepest = max(tree, key=lambda n: n["tokens"])
    assert "Where are the atlases?" in deepest["head"] and deepest["hits"] == 0
    assert deepest["tokens"] == first["usage"]["prompt_tokens"]
    by_id = {n["id"]: n for n in tree}
    for n in tree:  # each node adds text after its parent's end
        if n["parent"] is not None:
            assert n["start"] == by_id[n["parent"]]["tokens"] < n["tokens"]
    warm = chat(c, "Where are the atlases?")
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    after = {n["id"]: n for n in entries(c)}
    assert after[deepest["id"]]["hits"] == 1
    entry_id = deepest["entry_id"]
    assert c.post(f"/v1/cache/entries/{entry_id}/pin", json={"pinned": True}).status_code == 200
    assert entry_id in {e["entry_id"] for e in engine.views.cache_entries() if e["pinned"]}
    assert c.delete(f"/v1/cache/entries/{entry_id}").status_code == 409
    assert c.post(f"/v1/cache/entries/{entry_id}/pin", json={"pinned": False}).status_code == 200
    assert c.delete(f"/v1/cache/entries/{entry_id}").status_code == 200
    assert entry_id not in {e["entry_id"] for e in engine.views.cache_entries()}
    engine.store.check_integrity()


def test_real_engine_disk_only_nodes_after_memory_is_emptied(real):
    c, engine = real
    system = {"role": "system", "content": SYSTEM["content"] * 4}  # past the disk's min_tokens
    body = {"messages": [system, {"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    # written when the engine is idle, one file a turn
    assert wait_until(lambda: any(n["disk_bytes"] for n in entries(c)), timeout=30)
    saved = [n for n in entries(c) if n["disk_bytes"] is not None]
    assert saved and all(n["entry_id"] is not None for n in saved)  # in memory and on disk
    engine.store.clear()  # memory only: the files stay
    tree = entries(c)
    assert tree and all(n["entry_id"] is None and n["id"].startswith("d") for n in tree)
    assert {n["tokens"] for n in tree} == {n["tokens"] for n in saved}
    assert all(n["head"] for n in tree)
    body = c.get("/v1/dashboard").json()
    assert body["disk"]["files"] == len(tree) and body["disk"]["bytes"] > 0
