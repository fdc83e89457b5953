"""Cache namespaces over HTTP (server/guards/namespaces.py): who a request's namespace says
sent it, and that requests, cache_salt, listings, flush, warm, pins and the dashboard
keep to it. The fake engine for the routing, a real tiny model where caching matters."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request
from support.engine_helpers import open_engine
from support.live import post_chat
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.engine.keys import namespace_id
from mlx_prefix.server.guards.namespaces import Caller, Namespaces

MAIL = {"Origin": "chrome-extension://mailhelperextensionid"}
PAGE = {"Origin": "moz-extension://4b1d2c3e-unknown-page-script"}
SYSTEM = {"role": "system", "content": "You draft replies to the user's mail. " * 6}
KEY = "sesame"


def request(headers: dict[str, str], peer: str | None = "127.0.0.1") -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    client = (peer, 50000) if peer is not None else None
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw, "client": client})


# -- who sent it ------------------------------------------------------------------------


def test_each_origin_is_a_namespace_and_clients_without_one_share_one():
    ns = Namespaces("origin", None)
    mail, page = ns.caller(request(MAIL)), ns.caller(request(PAGE))
    assert mail.namespace != page.namespace and not mail.admin and not page.admin
    curl, sdk = ns.caller(request({})), ns.caller(request({}, peer="::1"))
    assert curl == sdk == Caller("", admin=True)  # local, no Origin: shared, sees all
    assert ns.caller(request({}, peer=None)) == curl  # a unix socket is local too
    # Another machine (a server bound beyond loopback) without an Origin: its own.
    remote = ns.caller(request({}, peer="192.168.1.20"))
    assert remote.namespace not in ("", ns.caller(request({}, peer="192.168.1.21")).namespace)
    assert not remote.admin


def test_the_dashboard_page_counts_as_local_but_a_rebound_name_does_not():
    ns = Namespaces("origin", None)
    own = {"Origin": "http://127.0.0.1:8080", "Host": "127.0.0.1:8080"}
    assert ns.caller(request(own)) == Caller("", admin=True)
    rebound = {"Origin": "http://evil.example:8080", "Host": "evil.example:8080"}
    assert not ns.caller(request(rebound)).admin
    other_port = {"Origin": "http://localhost:3000", "Host": "localhost:8080"}
    assert ns.caller(request(other_port)).namespace == "origin=http://localhost:3000"


def test_the_api_key_is_in_the_namespace_as_a_slow_digest_and_makes_an_admin():
    ns = Namespaces("origin", KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    mail = ns.caller(request({**MAIL, **auth}))
    assert mail.admin and KEY not in mail.namespace and KEY not in repr(mail)
    # After the key changes, what was cached under the old one is not the new holders'.
    rotated = Namespaces("origin", "new-key").caller(
        request({**MAIL, "Authorization": "Bearer new-key"})
    )
    assert rotated.admin and rotated.namespace != mail.namespace
    assert mail.namespace != ns.caller(request({**PAGE, **auth})).namespace  # origins still apart
    wrong = ns.caller(request({**MAIL, "Authorization": "Bearer nope"}))
    assert not wrong.admin and wrong.namespace == "origin=" + MAIL["Origin"]


def test_the_key_sent_as_x_api_key_is_the_same_holder_as_bearer():
    # Anthropic's SDK and Claude Code send the key as x-api-key: same namespace, admin.
    ns = Namespaces("origin", KEY)
    bearer = ns.caller(request({**MAIL, "Authorization": f"Bearer {KEY}"}))
    x_api_key = ns.caller(request({**MAIL, "x-api-key": KEY}))
    assert x_api_key == bearer and x_api_key.admin
    remote = {"x-api-key": KEY}  # another machine, no Origin: admin by the key alone
    assert ns.caller(request(remote, peer="192.168.1.20")).admin
    assert not ns.caller(request({**MAIL, "x-api-key": "nope"})).admin
    assert not Namespaces("origin", None).caller(request({**MAIL, "x-api-key": KEY})).admin


def test_global_sharing_is_one_namespace():
    ns = Namespaces("global", None)
    assert ns.caller(request(MAIL)).namespace == ns.caller(request(PAGE)).namespace == ""
    with pytest.raises(ValueError, match="cache_sharing"):
        Namespaces("per-user", None)


# -- the routes, on the fake engine -------------------------------------------------------


def chat(c: httpx.Client, headers: dict, question: str = "Reply to Bob.", **extra) -> int:
    body = {"messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 4}
    usage = post_chat(c, {**body, **extra}, headers=headers)["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def fake() -> Iterator[httpx.Client]:
    with serving() as (url, _), httpx.Client(base_url=url, timeout=10) as c:
        yield c


def test_two_origins_miss_each_other_and_hit_their_own(fake):
    assert chat(fake, MAIL) == 0 and chat(fake, PAGE) == 0
    assert chat(fake, MAIL) > 0 and chat(fake, PAGE) > 0
    assert chat(fake, {}) == 0  # curl does not match an extension's entries
    assert chat(fake, MAIL, cache_salt="alice") == 0  # a salt splits one origin
    assert chat(fake, MAIL, cache_salt="alice") > 0
    assert chat(fake, MAIL, cache_salt="bob") == 0


def test_cache_salt_is_honoured_by_completions_and_responses_or_refused(fake):
    prompt = {"prompt": "Summarize the mail thread for me please.", "max_tokens": 2}
    done = [fake.post("/v1/completions", json={**prompt, "cache_salt": s}) for s in "xxy"]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in done]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    body = {"input": "Summarize the mail thread.", "max_output_tokens": 2}
    first = fake.post("/v1/responses", json={**body, "cache_salt": "x"}).json()
    again = fake.post("/v1/responses", json={**body, "cache_salt": "x"}).json()
    other = fake.post("/v1/responses", json={**body, "cache_salt": "y"}).json()
    details = [r["usage"]["input_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert details[0] == 0 and details[1] > 0 and details[2] == 0
    for path, extra in (
        ("/v1/chat/completions", {"messages": [SYSTEM]}),
        ("/v1/responses", {"input": "x"}),
    ):
        for bad in ("", 7, ["a"]):
            r = fake.post(path, json={**extra, "cache_salt": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def listing(c: httpx.Client, headers: dict) -> list[dict]:
    r = c.get("/v1/cache", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["entries"]


def test_listings_flush_warm_pin_and_evict_are_the_callers_own(fake):
    chat(fake, MAIL)
    chat(fake, PAGE, "A question from a page.")
    chat(fake, {}, "A question from curl.")
    mine = listing(fake, MAIL)
    assert len(mine) == 1 and len(listing(fake, PAGE)) == 1 and len(listing(fake, {})) == 3
    assert {e["entry_id"] for e in mine} != {e["entry_id"] for e in listing(fake, PAGE)}
    theirs = listing(fake, PAGE)[0]["entry_id"]
    pin = fake.post(f"/v1/cache/entries/{theirs}/pin", json={"pinned": True}, headers=MAIL)
    assert pin.status_code == 404  # another's entry does not exist for this caller
    assert fake.delete(f"/v1/cache/entries/{theirs}", headers=MAIL).status_code == 404
    own = mine[0]["entry_id"]
    assert fake.post(f"/v1/cache/entries/{own}/pin", json={"pinned": True}, headers=MAIL).is_success
    warm = {"messages": [SYSTEM, {"role": "user", "content": "Warm me."}], "cache_salt": "s"}
    assert fake.post("/v1/cache/warm", json=warm, headers=MAIL).json()["cached_tokens"] == 0
    assert fake.post("/v1/cache/warm", json=warm, headers=PAGE).json()["cached_tokens"] == 0
    assert fake.post("/v1/cache/warm", json=warm, headers=MAIL).json()["cached_tokens"] > 0
    assert len(listing(fake, MAIL)) == 2  # its chat and its (salted) warm-up
    assert fake.delete("/v1/cache", headers=MAIL).json() == {"removed": 2}
    assert listing(fake, MAIL) == [] and len(listing(fake, PAGE)) == 2
    assert fake.delete("/v1/cache").json() == {"removed": 3}  # local, no Origin: all of it


def test_the_dashboard_shows_a_page_only_its_own(fake):
    chat(fake, MAIL)
    chat(fake, PAGE, "A question from a page.")
    mine = fake.get("/v1/dashboard", headers=MAIL).json()
    assert len(mine["tree"]) == 1 and len(mine["requests"]) == 1
    assert {n["namespace"] for n in mine["tree"]} == {namespace_id("origin=" + MAIL["Origin"])}
    assert {r["namespace"] for r in mine["requests"]} == {namespace_id("origin=" + MAIL["Origin"])}
    everything = fake.get("/v1/dashboard").json()  # the dashboard's own page: local
    assert len(everything["tree"]) == 2 and len(everything["requests"]) == 2


def test_the_admin_key_sees_every_namespace():
    auth = {"Authorization": f"Bearer {KEY}"}
    with serving(api_key=KEY) as (url, _), httpx.Client(base_url=url, timeout=10) as c:
        chat(c, {**MAIL, **auth})
        chat(c, {**PAGE, **auth}, "A question from a page.")
        assert len(listing(c, {**MAIL, **auth})) == 2
        assert c.delete("/v1/cache", headers={**MAIL, **auth}).json() == {"removed": 2}


def test_x_api_key_and_bearer_share_one_namespace_over_http():
    bearer = {**MAIL, "Authorization": f"Bearer {KEY}"}
    x_api_key = {**MAIL, "x-api-key": KEY}
    with serving(api_key=KEY) as (url, _), httpx.Client(base_url=url, timeout=10) as c:
        assert chat(c, bearer) == 0
        assert chat(c, x_api_key) > 0  # the Bearer request's entries are its own
        chat(c, {**PAGE, **x_api_key}, "A question from a page.")
        assert len(listing(c, x_api_key)) == 2  # admin: sees the page's entries too
        assert c.delete("/v1/cache", headers=x_api_key).json() == {"removed": 2}


def test_global_sharing_shares_between_origins():
    with serving(cache_sharing="global") as (url, _), httpx.Client(base_url=url, timeout=10) as c:
        assert chat(c, MAIL) == 0
        assert chat(c, PAGE) > 0 and chat(c, {}) > 0
        assert chat(c, PAGE, cache_salt="s") == 0  # a salt still splits


# -- a real model: the hit is real, and the answer is the cold run's ----------------------


def test_two_extensions_over_http_with_a_real_model(tmp_path):
    with open_engine(loaded_test_model("dense"), TEST_CACHE) as engine:
        with serving(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as c:

            def ask(headers: dict, **extra) -> tuple[int, str]:
                body = {"messages": [SYSTEM, {"role": "user", "content": "Reply to Bob."}]}
                r = c.post(
                    "/v1/chat/completions",
                    json={**body, "max_tokens": 8, "temperature": 0, **extra},
                    headers=headers,
                )
                assert r.status_code == 200, r.text
                out = r.json()
                cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                return cached, out["choices"][0]["message"]["content"]

            cold = ask({}, prefix_cache={"enabled": False})
            assert cold[0] == 0
            first = [ask(MAIL), ask(PAGE)]
            assert [cached for cached, _ in first] == [0, 0]
            again = [ask(MAIL), ask(PAGE)]
            assert all(cached > 40 for cached, _ in again)
            assert {text for _, text in first + again} == {cold[1]}
            assert ask({})[0] == 0  # nor does curl see the extensions' entries


def test_a_client_pins_only_its_share_and_others_still_cache(tmp_path):
    """Pins are never evicted: without a bound, one page could warm-and-pin the budget
    full and no one else's prompt would be stored again."""
    with open_engine(loaded_test_model("dense"), TEST_CACHE) as engine:
        with serving(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as c:

            def warm(headers: dict, text: str) -> httpx.Response:
                body = {"messages": [SYSTEM, {"role": "user", "content": text}], "pin": True}
                return c.post("/v1/cache/warm", json=body, headers=headers)

            assert warm(PAGE, "A page's own prompt.").json()["pinned"] is True
            one = sum(e.nbytes for e in engine.store.entries() if e.pinned)
            engine.store.pin_share = 1.5 * one / engine.store.budget_bytes
            assert warm(MAIL, "Reply to Bob.").json()["pinned"] is True
            # Stored once, Alice's prompt adds only what follows the system prompt it
            # shares with Bob's: long enough that this alone passes the share.
            refused = warm(MAIL, "Reply to Alice, at length, about the mail you got today. " * 12)
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert error["code"] == "pin_quota_exceeded" and "--pin-share" in error["message"]
            entries = c.get("/v1/cache", headers=MAIL).json()["entries"]
            assert [e["pinned"] for e in entries].count(True) >= 1
            assert not all(e["pinned"] for e in entries)  # stored, but not pinned
            unpinned = next(e["entry_id"] for e in entries if not e["pinned"])
            pin = c.post(f"/v1/cache/entries/{unpinned}/pin", json={"pinned": True}, headers=MAIL)
            assert pin.status_code == 409 and pin.json()["error"]["code"] == "pin_quota_exceeded"
            # Everyone else's prompts are still stored and hit.
            body = {"messages": [{"role": "user", "content": "Hello there, " * 20}]}
            for cached in (False, True):
                r = c.post("/v1/chat/completions", json={**body, "max_tokens": 2})
                hit = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (hit > 0) is cached
