"""The benchmarks' peers: vllm-mlx in its own venv (left out, with the reason, where it
is not installed), how it is started and addressed, and mlx-prefix flags the benchmark
passes only where `mlx-prefix serve --help` lists them; a connection a peer drops before
answering is sent again. Where vllm-mlx is installed (`make peers`), it serves the
workloads' requests on a tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from benchmarks import peers, servers
from benchmarks.client import Request, send
from benchmarks.harness import run_async
from benchmarks.names import OURS, PEER, VLLM
from benchmarks.servers import Server, ServerFailed, ServerSpec, start_all, unavailable
from mlx_prefix.models.testing import cached_test_model


def test_vllm_mlx_is_left_out_with_the_reason_until_make_peers_installs_it(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "vllm-mlx"
    why = peers.vllm_mlx_problem(venv)
    assert why is not None and "not installed" in why and "make peers" in why
    # Installed with other pins than the benchmark compares with: not used either.
    (venv / "bin").mkdir(parents=True)
    peers.vllm_mlx_command(venv).write_text("#!/bin/sh\n")
    (venv / peers.STAMP.name).write_text("vllm-mlx==0.5.0\nmlx[cpu]==0.30.0\n")
    assert "other versions" in (peers.vllm_mlx_problem(venv) or "")
    (venv / peers.STAMP.name).write_text("\n".join(peers.requirements()) + "\n")
    assert peers.vllm_mlx_problem(venv) is None
    assert f"vllm-mlx=={peers.VLLM_MLX_VERSION}" in peers.requirements()
    assert any(r.startswith("mlx") and r.endswith(f"=={peers.MLX_VERSION}")
               for r in peers.requirements())  # fmt: skip
    # Never on several ranks; mlx_lm.server always.
    assert "one rank" in (unavailable(VLLM, ranks=2) or "")
    assert unavailable(PEER) is None


def test_vllm_mlx_is_served_with_continuous_batching_and_named_by_its_path(
    tmp_path: Path,
) -> None:
    spec = ServerSpec(VLLM, tmp_path / "model", (), "vllm-mlx")
    argv = spec.argv(8123)
    serve = argv.index(str(peers.vllm_mlx_command()))
    assert argv[:3] == [argv[0], "-m", "mlx_prefix.blas_exec"]  # the same fast BLAS
    assert argv[serve + 1 : serve + 3] == ["serve", str(tmp_path / "model")]
    assert "--continuous-batching" in argv and argv[argv.index("--port") + 1] == "8123"
    assert spec.request_model == str(tmp_path / "model") and spec.own_home
    _, body = Request(messages=[{"role": "user", "content": "Hi"}]).body(model="m")
    assert body["model"] == "m"
    for name in (OURS, PEER):  # they serve their one model without being told
        other = ServerSpec(name, tmp_path / "model")
        assert other.request_model is None and not other.own_home
        assert "model" not in Request(prompt="Hi").body(model=other.request_model)[1]


def test_an_optional_server_that_fails_to_start_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Fails(Server):
        def launch(self) -> Server:
            return self

        def wait_ready(self, timeout_s: float = 300.0) -> Server:
            if self.spec.name == VLLM:
                raise ServerFailed("vllm-mlx exited (1)")
            return self

    monkeypatch.setattr(servers, "new_server", lambda spec, log_dir: Fails(spec, log_dir))
    specs = [ServerSpec(OURS, tmp_path), ServerSpec(VLLM, tmp_path)]
    logged: list[str] = []
    up = start_all(specs, tmp_path, optional=(VLLM,), log=logged.append)
    assert [s.name for s in up] == [OURS] and "vllm-mlx exited" in logged[0]
    with pytest.raises(ServerFailed):  # a server the run needs fails the run
        start_all(specs, tmp_path)


def test_flags_are_read_from_mlx_prefix_serve_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "ours_help", lambda: "  --deterministic  batch-invariant")
    assert servers.has_flag("--deterministic")
    monkeypatch.setattr(servers, "ours_help", lambda: "  --deterministic-probe  other")
    assert not servers.has_flag("--deterministic")  # a whole word, not a prefix


def test_vllm_mlx_serves_a_workload_request(tmp_path: Path) -> None:
    why = peers.vllm_mlx_problem()
    if why is not None:
        pytest.skip(why)
    spec = ServerSpec(VLLM, cached_test_model("dense"), (), "vllm-mlx")
    server = Server(spec, tmp_path / "logs").start()  # its warm-up request names the model
    home = server._home
    try:
        assert home is not None and home.is_dir()
        req = Request(messages=[{"role": "user", "content": "Hello there"}], max_tokens=4)
        reply = run_async(lambda c: send(c, server, req))
        assert reply.completion_tokens and reply.prompt_tokens and reply.chunk_times
    finally:
        server.stop()
    assert not home.exists()  # nothing it saved is there for the next run


def _sse(*chunks: str) -> bytes:
    return "".join(f"data: {c}\n\n" for c in (*chunks, "[DONE]")).encode()


def test_a_connection_dropped_before_any_response_is_sent_again() -> None:
    calls = []
    done = _sse(
        '{"choices": [{"delta": {"content": "Hi"}, "finish_reason": null}]}',
        '{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}',
    )

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=done)

    async def go() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, "http://peer", Request(prompt="Hello"))

    reply = asyncio.run(go())
    assert len(calls) == 2 and reply.retries == 1 and reply.text == "Hi"
    assert reply.completion_tokens == 1


def test_a_failure_after_the_response_began_is_not_sent_again() -> None:
    calls = []

    async def broken() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
        raise httpx.ReadError("connection reset")

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, stream=_Stream(broken()))

    async def go() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, "http://peer", Request(prompt="Hello"))

    with pytest.raises(RuntimeError, match="ReadError"):
        asyncio.run(go())
    assert len(calls) == 1  # served once: a second try would be a second request


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for c in self._chunks:
            yield c
