"""`mlx-prefix serve --ollama`: the server also listens on Ollama's address, and refuses
to start, before loading anything, when something already listens there. The tests
use an address of their own (`--ollama 127.0.0.1:PORT`), never Ollama's real port, which
a developer's Ollama may hold."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import pytest
from support.served_process import serve_process
from support.server_fakes import serving

from mlx_prefix.cli import build_parser, main
from mlx_prefix.cli.serve_args import server_settings
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.server.ollama_port import PortTaken, bind_ollama_port, split_address


def settings(*flags: str):
    return server_settings(build_parser().parse_args(["serve", *flags]))


def test_the_flag_names_ollamas_address_or_another(monkeypatch):
    assert settings().ollama is None
    assert settings("--ollama").ollama == "127.0.0.1:11434"
    assert settings("--ollama", "127.0.0.1:5005").ollama == "127.0.0.1:5005"
    monkeypatch.setenv("MLX_PREFIX_SERVER_OLLAMA", "127.0.0.1:6006")
    assert settings().ollama == "127.0.0.1:6006"
    assert split_address("[::1]:7007") == ("::1", 7007) and split_address("8008")[1] == 8008
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        settings("--ollama", "localhost:port")


def test_an_address_an_ollama_holds_is_refused_saying_so():
    with serving() as (url, _):  # answers "Ollama is running", as Ollama does
        with pytest.raises(PortTaken, match="an Ollama server already listens on"):
            bind_ollama_port(url.removeprefix("http://"))


def test_an_address_another_program_holds_is_refused_saying_so():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        address = f"127.0.0.1:{other.getsockname()[1]}"
        with pytest.raises(PortTaken, match="is taken .*another program listens there"):
            bind_ollama_port(address)


def test_serve_stops_before_loading_the_model_when_the_port_is_taken(capsys):
    with serving() as (url, _):
        # A model that does not exist: loading it would fail with another message.
        argv = ["serve", "--model", "/nonexistent/model", "--ollama", url.removeprefix("http://")]
        # On a thread of its own: main() ends by destroying its thread's MLX streams (as
        # the process's last act), which would leave this one without any.
        with ThreadPoolExecutor(1) as pool:
            code = pool.submit(main, argv).result(timeout=120)
    err = capsys.readouterr().err
    assert code == 1 and "an Ollama server already listens on" in err
    assert "nonexistent" not in err


def test_serve_answers_on_both_addresses():
    model = str(cached_test_model("dense"))
    cmd = [sys.executable, "-m", "mlx_prefix", "serve", "--model", model, "--port", "0",
           "--ollama", "127.0.0.1:0", "--disk-cache", "off", "--no-prefetch"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with serve_process(cmd, stop_timeout=60, env=env, text=True) as proc:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        ports = _ports(lines, proc)
        answers = []
        for port in ports:
            with ollama.Client(host=f"http://127.0.0.1:{port}") as c:
                answers.append(c.generate(model="tiny-dense", prompt="Hi", options={
                    "temperature": 0, "num_predict": 4}).response)  # fmt: skip
            assert httpx.get(f"http://127.0.0.1:{port}/").text == "Ollama is running"
        assert answers[0] == answers[1]
    assert proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM)


def _ports(lines: list[str], proc: subprocess.Popen) -> list[int]:
    """The main port (uvicorn's line) and Ollama's (ours), once the server answers."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        text = "".join(lines)
        main_port = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", text)
        ollama_port = re.search(r"Ollama's address: http://127\.0\.0\.1:(\d+)", text)
        if main_port and ollama_port:  # bound: each answers once the app has started
            ports = [int(main_port.group(1)), int(ollama_port.group(1))]
            try:
                for port in ports:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
                return ports
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    raise AssertionError("the server did not start:\n" + "".join(lines))
