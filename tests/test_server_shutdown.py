"""`serve()` in its own process: SIGTERM stops accepting, lets a short in-flight request
finish, cancels a long one after the grace period (the client gets an error event, not a
cut connection), then shuts the engine down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.servers import free_port

TESTS = Path(__file__).parent
SCRIPT = """
import sys
from server_fakes import FakeEngine
from mlx_prefix.server import ServerSettings, serve

engine = FakeEngine()
real_shutdown = engine.shutdown

def shutdown(timeout=10.0):
    print("ENGINE_SHUTDOWN", engine._closed, flush=True)
    real_shutdown(timeout)

engine.shutdown = shutdown
serve(engine, ServerSettings(port=int(sys.argv[1]), shutdown_grace_s=float(sys.argv[2]),
                             log_level="warning"))
"""


def run_shutdown(grace_s: float, reply_words: int, delay: float) -> tuple[str, str, int, float]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    cmd = [sys.executable, "-c", SCRIPT, str(port), str(grace_s)]
    url = f"http://127.0.0.1:{port}"
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            with httpx.Client(base_url=url, timeout=10) as c:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        c.get("/health")
                        break
                    except httpx.TransportError:
                        if time.monotonic() > deadline or proc.poll() is not None:
                            raise
                        time.sleep(0.05)
                reply = " ".join(["w"] * reply_words)
                body = {
                    "stream": True,
                    "messages": [
                        {"role": "user", "content": f"[[delay:{delay}]] [[reply:{reply}]]"}
                    ],
                }
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = r.iter_lines()
                    first = next(lines)
                    signalled = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    time.sleep(0.3)
                    with pytest.raises(httpx.ConnectError):  # no longer accepting
                        httpx.get(url + "/health", timeout=2)
                    text = "\n".join([first, *lines])
                    elapsed = time.monotonic() - signalled
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return text, out.decode() + err.decode(), proc.returncode, elapsed


def payloads(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def test_sigterm_lets_a_short_request_finish():
    text, output, returncode, _ = run_shutdown(grace_s=5, reply_words=10, delay=0.08)
    events = payloads(text)
    assert events[-1] == "[DONE]", text
    assert returncode == -signal.SIGTERM, output
    assert "ENGINE_SHUTDOWN False" in output  # the engine was shut down, once, by serve()
    assert output.count("ENGINE_SHUTDOWN") == 1


def test_sigterm_cancels_a_long_request_after_the_grace_period():
    text, output, returncode, elapsed = run_shutdown(grace_s=0.5, reply_words=400, delay=0.05)
    events = payloads(text)
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "request_cancelled", text
    assert elapsed < 5  # well before the reply's 20 s
    assert returncode == -signal.SIGTERM, output
    assert "ENGINE_SHUTDOWN" in output
