"""A stand-in for the Hugging Face Hub on loopback, for `mlx-prefix pull` with no network.

huggingface-hub honours HF_ENDPOINT; this answers what `snapshot_download` asks:
`/api/models/{repo}[/revision/{rev}]` (the commit and file list), `/api/models/{repo}/tree/
{rev}` (sizes), and HEAD / GET `/{repo}/resolve/{rev}/{file}` with X-Repo-Commit, ETag and
Content-Length, and HTTP Range. Unknown repos and revisions get the Hub's 404s (with its
X-Error-Code). `drop_once` cuts one file's first download after some bytes, as a
dropped connection would. Every request is recorded (method, path, headers).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    commit: str
    files: dict[str, bytes]
    branches: tuple[str, ...] = ("main",)  # names that resolve to `commit`

    @classmethod
    def from_folder(cls, folder: Path, commit: str | None = None) -> Repo:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        digest = hashlib.sha1(b"".join(files.values())).hexdigest()
        return cls(commit or digest, files)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class StandInHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_once: dict[str, int] = field(default_factory=dict)  # file name -> bytes sent first
    seen: list[Seen] = field(default_factory=list)

    def __enter__(self) -> StandInHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def gets(self, name: str) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and s.path.endswith("/" + name)]

    # -- answers ------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.seen.append(Seen(h.command, path, {k.lower(): v for k, v in h.headers.items()}))
        api = re.fullmatch(r"/api/models/(.+?)(?:/(revision|tree)/([^/]+)(/.*)?)?", path)
        if api:
            repo, what, rev = api.group(1), api.group(2) or "revision", api.group(3) or "main"
            found = self._repo(h, repo, rev)
            if found is None:
                return
            if what == "revision":
                body = {"id": repo, "sha": found.commit,
                        "siblings": [{"rfilename": n} for n in found.files]}  # fmt: skip
            else:
                body = [
                    {"type": "file", "path": n, "size": len(b), "oid": _oid(b)}
                    for n, b in found.files.items()
                ]
            self._send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})
            return
        resolve = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
        if resolve is None:
            self._send(h, 404, b"not found", {})
            return
        repo, rev, name = resolve.groups()
        found = self._repo(h, repo, rev)
        if found is None:
            return
        data = found.files.get(name)
        if data is None:
            self._send(h, 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
            return
        headers = {
            "X-Repo-Commit": found.commit,
            "ETag": f'"{_oid(data)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        start = 0
        wanted = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if wanted and not head:
            start = int(wanted.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        cut = None if head or start else self.drop_once.pop(name, None)
        self._send(h, 206 if start else 200, body, headers, head=head, cut=cut)

    def _repo(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> Repo | None:
        found = self.repos.get(repo)
        if found is None:
            missing = {"X-Error-Code": "RepoNotFound"}
            self._send(h, 404, b'{"error": "Repository not found"}', missing)
            return None
        if rev not in (*found.branches, found.commit):
            self._send(h, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
            return None
        return found

    @staticmethod
    def _send(h, status, body, headers, head=False, cut=None) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        if cut is None:
            h.wfile.write(body)
            return
        h.wfile.write(body[:cut])  # then the connection drops mid-file
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(2)


def _oid(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
