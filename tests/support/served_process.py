"""A server child process started with `--port 0` (or `ServerSettings(port=0)`): the
system picks a free port when it binds, and the startup line names it. A port probed
free beforehand (benchmarks' free_port) can be taken by anyone before the child binds."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

SERVING = re.compile(r"serving .* on http://\S+:(\d+) ")


class StderrReader:
    """Reads a child's stderr on a thread until it ends (so the pipe never fills), keeping
    every line; `port` waits for the startup line."""

    def __init__(self, proc: subprocess.Popen):
        assert proc.stderr is not None
        self.lines: list[str] = []
        self._port: int | None = None
        self._told = threading.Event()  # the startup line came, or stderr ended
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            self.lines.append(line)
            found = SERVING.search(line)
            if found and self._port is None:
                self._port = int(found.group(1))
                self._told.set()
        self._told.set()

    def port(self, timeout: float) -> int:
        """The port the child bound (`timeout`: a deadline for a child that hangs)."""
        self._told.wait(timeout)
        if self._port is None:
            raise AssertionError(f"no startup line naming a port:\n{self.text(0)[-3000:]}")
        return self._port

    def text(self, timeout: float = 30) -> str:
        """Everything read, once stderr ended (or `timeout` passed)."""
        self._thread.join(timeout)
        return "".join(self.lines)


@contextlib.contextmanager
def serve_process(
    cmd: list[str], stop_timeout: float = 120, **popen: Any
) -> Iterator[subprocess.Popen]:
    """`cmd` (an `mlx-prefix serve`) running with its stderr piped, for the block: at its
    end a SIGTERM and `stop_timeout` to stop; killed if the block failed or it did not."""
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, **popen) as proc:
        try:
            yield proc
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=stop_timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
