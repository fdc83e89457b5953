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

import httpx
from support.paths import REPO, TESTS
from support.served_process import StderrReader

SCRIPT = """
import sys
from support.server_fakes import FakeEngine
from mlx_prefix.server import ServerSettings, serve

engine = FakeEngine()
real_shutdown = engine.shutdown

def shutdown(timeout=10.0):
    print("ENGINE_SHUTDOWN", engine._closed, flush=True)
    real_shutdown(timeout)

engine.shutdown = shutdown
serve(engine, ServerSettings(port=0, shutdown_grace_s=float(sys.argv[1]), log_level="info"))
"""


def run_shutdown(grace_s: float, reply_words: int, delay: float) -> tuple[str, str, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    cmd = [sys.executable, "-c", SCRIPT, str(grace_s)]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            err = StderrReader(proc)
            url = f"http://127.0.0.1:{err.port(timeout=60)}"
            with httpx.Client(base_url=url, timeout=10) as c:
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
                    proc.send_signal(signal.SIGTERM)
                    _until_refused(url + "/health")  # no longer accepting
                    text = "\n".join([first, *lines])
            proc.wait(timeout=60)
            out = proc.stdout.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return text, out + err.text(), proc.returncode


def _until_refused(url: str, deadline_s: float = 30) -> None:
    """Poll until a connection to `url` is refused, or closed or reset unanswered (one the
    kernel queued as the server closed its socket: it ends with a FIN or, as CI saw once,
    an RST) (`deadline_s`: a deadline for a server that goes on accepting)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            httpx.get(url, timeout=2)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            return
        except httpx.ReadTimeout:
            pass  # queued but not yet closed: ask again
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.02)


def payloads(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def test_sigterm_lets_a_short_request_finish():
    # A grace period far longer than the reply: shutdown goes on once the request ends.
    text, output, returncode = run_shutdown(grace_s=60, reply_words=10, delay=0.08)
    events = payloads(text)
    assert events[-1] == "[DONE]", text
    assert returncode == -signal.SIGTERM, output
    assert "ENGINE_SHUTDOWN False" in output  # the engine was shut down, once, by serve()
    assert output.count("ENGINE_SHUTDOWN") == 1


def test_sigterm_cancels_a_long_request_after_the_grace_period():
    # The reply would take 20 s; the grace period ends it (an error event, not a cut).
    text, output, returncode = run_shutdown(grace_s=0.5, reply_words=400, delay=0.05)
    events = payloads(text)
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "request_cancelled", text
    assert 1 < len(events) < 400
    assert returncode == -signal.SIGTERM, output
    assert "ENGINE_SHUTDOWN" in output
