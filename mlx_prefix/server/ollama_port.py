"""`serve --ollama`: the server also listens on 127.0.0.1:11434, the address Ollama's
clients and apps reach without a setting (or on the address `--ollama HOST:PORT` names).
The port is taken before the model loads, so a server that cannot have it stops at
once, saying what holds it: an Ollama (or another server answering as one), or some
other program."""

from __future__ import annotations

import socket
import urllib.request

from mlx_prefix.errors import MlxPrefixError

OLLAMA_ADDRESS = "127.0.0.1:11434"
_PROBE_S = 2.0


class PortTaken(MlxPrefixError):
    """Ollama's port is held by another program."""

    code = "port_taken"


def split_address(address: str) -> tuple[str, int]:
    """ "HOST:PORT" (or ":PORT", or "PORT": on 127.0.0.1) -> (host, port); ValueError."""
    host, sep, port = address.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--ollama: {address!r} is not HOST:PORT (such as {OLLAMA_ADDRESS})")
    return (host.strip("[]") if sep and host else "127.0.0.1"), int(port)


def covered(host: str, port: int, address: str) -> bool:
    """Whether the server's own address already is the Ollama address."""
    want_host, want_port = split_address(address)
    return port == want_port != 0 and host in (want_host, "0.0.0.0", "")


def bind_ollama_port(address: str = OLLAMA_ADDRESS) -> socket.socket:
    """A socket bound to the Ollama address (uvicorn listens on it beside the main one).
    PortTaken, saying what holds it, when it is in use."""
    host, port = split_address(address)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortTaken(_holder(host, port, e)) from None
    sock.set_inheritable(True)
    return sock


def bound_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _holder(host: str, port: int, error: OSError) -> str:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with urllib.request.urlopen(f"http://{where}/", timeout=_PROBE_S) as r:  # noqa: S310
            running = b"Ollama is running" in r.read(256)
    except (OSError, ValueError):
        running = False
    if running:
        return (
            f"--ollama: an Ollama server already listens on {where} (Ollama itself, or "
            "another server started with --ollama); quit it (the Ollama app, or "
            "`ollama serve`), or start without --ollama and point the clients at this "
            "server's --port"
        )
    return (
        f"--ollama: {where} is taken ({error.strerror or error}); another program "
        "listens there: stop it, or start without --ollama"
    )
