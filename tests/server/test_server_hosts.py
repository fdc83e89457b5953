"""The Host check against DNS rebinding (server/guards/hosts.py, middleware.HostGuard): which
names a Host header may carry, and that every route refuses the others in one place,
in its API family's error shape."""

from __future__ import annotations

import httpx
import pytest
from support.server_fakes import serving

from mlx_prefix.cli import build_parser
from mlx_prefix.cli.serve_args import server_settings
from mlx_prefix.server.guards.hosts import HostPolicy, host_name
from mlx_prefix.server.settings import ServerSettings

EVIL = "evil.example"


def test_host_name_drops_port_brackets_case_and_the_final_dot():
    assert host_name("LocalHost:8080") == "localhost"
    assert host_name("[::1]:8080") == "::1"
    assert host_name("localhost.") == "localhost"
    assert host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("::1") == "::1"  # a bare IPv6 address keeps its colons


def test_loopback_names_and_the_bound_address_pass_other_names_do_not():
    policy = HostPolicy("127.0.0.1")
    for ok in ("localhost:8080", "127.0.0.1:8080", "127.8.9.10", "[::1]:8080", "localhost.", None):
        assert policy.allows(ok), ok
    for bad in (f"{EVIL}:8080", EVIL, "localhost.evil.example", "10.0.0.5:8080", "mybox"):
        assert not policy.allows(bad), bad
    lan = HostPolicy("192.168.1.20")
    assert lan.allows("192.168.1.20:8080") and lan.allows("localhost")
    assert not lan.allows("192.168.1.21") and not lan.allows(EVIL)


def test_a_wildcard_bind_accepts_ip_literals_and_the_machines_own_name_only():
    policy = HostPolicy("0.0.0.0", machine_name="Studio.local")
    for ok in ("192.168.1.20:8080", "[fe80::1]:8080", "studio.local:8080", "studio"):
        assert policy.allows(ok), ok
    assert not policy.allows(f"{EVIL}:8080") and not policy.allows("studio.evil.example")
    assert HostPolicy("::", machine_name="studio").allows("studio.local")


def test_allowed_hosts_and_allowed_origins_add_names():
    policy = HostPolicy(
        "127.0.0.1",
        allowed_hosts=("llm.example.com", ".lab.example"),
        allowed_origins=("https://app.example.org", "*"),
    )
    for ok in ("llm.example.com:443", "lab.example", "gpu.lab.example", "app.example.org"):
        assert policy.allows(ok), ok
    for bad in ("example.com", "evillab.example", "other.example.org"):
        assert not policy.allows(bad), bad
    assert HostPolicy("127.0.0.1", allowed_hosts=("*",)).allows(EVIL)


@pytest.mark.parametrize("bad", ["https://llm.example.com", "llm.example.com:8080", "a b", ""])
def test_an_allowed_host_that_could_never_match_is_refused(bad):
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerSettings(allowed_hosts=(bad,))


def test_the_flag_and_the_environment_variable(monkeypatch):
    parse = build_parser().parse_args
    args = parse(["serve", "--allowed-hosts", "llm.example.com", ".lab.example"])
    assert server_settings(args).allowed_hosts == ("llm.example.com", ".lab.example")
    monkeypatch.setenv("MLX_PREFIX_SERVER_ALLOWED_HOSTS", "a.example, B.example")
    assert server_settings(parse(["serve"])).allowed_hosts == ("a.example", "b.example")


# Every kind of route: the API (both prefixes, both families), the admin routes, the
# dashboard, /health and /metrics, and a CORS preflight.
ROUTES = [
    ("GET", "/v1/cache"),
    ("GET", "/v1/models"),
    ("GET", "/models/%2Fetc"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/responses"),
    ("DELETE", "/v1/cache"),
    ("POST", "/v1/cache/warm"),
    ("DELETE", "/v1/cache/entries/1"),
    ("GET", "/v1/dashboard"),
    ("GET", "/dashboard"),
    ("GET", "/"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("OPTIONS", "/v1/chat/completions"),
]
CHAT = {"messages": [{"role": "user", "content": "What is in the cache?"}], "max_tokens": 4}


def test_every_route_refuses_a_rebound_host_and_serves_a_loopback_one():
    with serving() as (url, engine), httpx.Client(base_url=url, timeout=10) as c:
        port = c.base_url.port
        for method, path in ROUTES:
            for host in (f"{EVIL}:{port}", EVIL):
                r = c.request(method, path, json=CHAT, headers={"Host": host})
                assert r.status_code == 403, (method, path, r.text)
                if path == "/v1/messages":
                    assert r.json() == {
                        "type": "error",
                        "error": {
                            "type": "permission_error",
                            "message": r.json()["error"]["message"],
                        },
                    }
                else:
                    assert r.json()["error"]["code"] == "host_not_allowed", (method, path)
        assert not engine.submissions  # nothing reached the engine
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert c.get("/v1/cache", headers={"Host": host}).status_code == 200
            r = c.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
            assert r.status_code == 200, r.text


def test_allowed_hosts_let_a_name_in():
    with serving(allowed_hosts=("llm.example.com",)) as (url, _):
        assert httpx.get(url + "/health", headers={"Host": "llm.example.com:8080"}).is_success
        refused = httpx.get(url + "/health", headers={"Host": EVIL})
        assert refused.status_code == 403
