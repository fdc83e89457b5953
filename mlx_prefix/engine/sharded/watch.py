"""PeerWatch: one plain TCP connection between rank 0 and every other rank of a sharded
server, held open while the group serves, so that a rank that dies is noticed even when
the backend does not say so.

The ring backend reports a lost peer by raising from the collective in progress, but
not always: measured here (mlx 0.32.4), an evaluation holding several sums in a row (a
forward of a tensor-parallel model) waits forever after its peer is killed ("Too many
send/recv errors. Failing pending tasks..." is printed, the evaluation never returns).
The kernel closes a dead process's sockets, even on SIGKILL, and TCP keepalive notices a
machine that went away, so a thread blocked reading this connection wakes up and calls
`on_lost`. Nothing is ever sent on it after the hello.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from mlx_prefix.engine.sharded.group import Channel

log = logging.getLogger("mlx_prefix.engine")

CONNECT_S = 60.0  # every rank connects within this at startup


class PeerWatch:
    def __init__(self, rank: int, peers: dict[int, socket.socket]):
        self.rank = rank
        self.peers = peers  # rank -> connection (rank 0: every other rank; others: rank 0)

    @classmethod
    def connect(cls, channel: Channel, backend: str) -> PeerWatch:
        """Open the connections (every rank calls this at startup: it runs a collective).
        A rank that cannot connect logs why and is watched by the backend alone."""
        listener = None
        blob = b""
        if channel.leader:
            host = leader_host(backend)
            listener = socket.create_server((host or "", 0))
            listener.settimeout(CONNECT_S)
            blob = json.dumps([host or socket.gethostname(), listener.getsockname()[1]]).encode()
        host, port = json.loads(channel.gather_bytes(blob)[0])
        peers: dict[int, socket.socket] = {}
        try:
            if listener is not None:
                while len(peers) < channel.size - 1:
                    conn, _ = listener.accept()
                    (rank,) = struct.unpack("<I", _read(conn, 4))
                    peers[rank] = conn
            else:
                conn = socket.create_connection((host, port), timeout=CONNECT_S)
                conn.sendall(struct.pack("<I", channel.rank))
                peers[0] = conn
        except OSError as e:
            log.warning("rank %d: no watch connection (%s): a lost rank shows only when "
                        "the backend reports it", channel.rank, e)  # fmt: skip
        finally:
            if listener is not None:
                listener.close()
        for conn in peers.values():
            conn.settimeout(None)
            _keepalive(conn)
        return cls(channel.rank, peers)

    def close(self) -> None:
        for conn in self.peers.values():
            conn.close()

    def start(self, on_lost: Callable[[int], None]) -> None:
        """Watch every connection in a daemon thread: `on_lost(rank)` when one closes."""
        for rank, conn in self.peers.items():
            threading.Thread(
                target=_watch,
                args=(rank, conn, on_lost),
                name=f"mlx-prefix-watch-{rank}",
                daemon=True,
            ).start()


def leader_host(backend: str) -> str | None:
    """The address the other ranks reach rank 0 at, from the launcher's settings."""
    if backend == "ring" and (path := os.environ.get("MLX_HOSTFILE")):
        try:
            with open(path) as f:
                hosts = json.load(f)
            return str(hosts[0][0]).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            return None
    if backend == "jaccl" and (coordinator := os.environ.get("MLX_JACCL_COORDINATOR")):
        return coordinator.rsplit(":", 1)[0]
    return None


def _watch(rank: int, conn: socket.socket, on_lost: Callable[[int], None]) -> None:
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    on_lost(rank)


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise OSError("closed during the hello")
        data += chunk
    return data


def _keepalive(conn: socket.socket) -> None:
    """Probe an idle connection after 10 s, every 5 s, give up after 3: a machine that
    lost power (no FIN, no RST) shows within ~25 s."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPALIVE", 10), ("TCP_KEEPINTVL", 5)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_KEEPCNT"):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
