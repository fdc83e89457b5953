"""Embeddings per second of `POST /v1/embeddings`, this server beside another.

    python -m benchmarks.studies.embeddings [--size qwen3-0.6b] [--peer-url URL --peer-model NAME]

Without `--url` it starts `mlx-prefix serve` itself (a tiny chat model, `--embedding-model`
a folder of random weights in Qwen3-Embedding-0.6B's shapes, or the folder given), and
stops it after. `--peer-url` measures a second server (vllm-mlx, LM Studio, Ollama's
OpenAI route...) on the same requests; `--peer-model` is the `model` it wants (vllm-mlx:
the path it was started with). Both get `encoding_format: float` and the same texts
(KJV verses: `short` one verse per input, `long` about 256 tokens per input).

Each cell sends `--inputs` inputs in requests of `batch` inputs from `concurrency` client
threads, after one warm-up request, and reports inputs/s, tokens/s (the server's own
usage count) and the median request latency. With a peer, `--check` compares the two
servers' vectors for the same inputs (cosine), which says they run the same model the
same way: random weights make no meaningful embeddings, but the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.corpus import verses
from benchmarks.servers import free_port

WORKLOADS = ("short", "long")


@dataclass(frozen=True)
class Target:
    label: str
    url: str  # base URL, without /v1
    model: str  # the request's `model`


@dataclass(frozen=True)
class Cell:
    server: str
    workload: str
    batch: int  # inputs per request
    concurrency: int  # client threads
    inputs: int
    seconds: float
    tokens: int  # summed usage.prompt_tokens
    p50_request_s: float

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def texts(workload: str, n: int, offset: int = 0) -> list[str]:
    vs = verses()
    if workload == "short":
        return [vs[(offset + i) % len(vs)] for i in range(n)]
    # ~256 tokens: eight consecutive verses
    return [" ".join(vs[(offset + 8 * i + j) % len(vs)] for j in range(8)) for i in range(n)]


def embed(client: httpx.Client, target: Target, batch: list[str]) -> dict[str, Any]:
    body = {"model": target.model, "input": batch, "encoding_format": "float"}
    r = client.post("/v1/embeddings", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{target.label}: {r.status_code} {r.text[:300]}")
    return r.json()


def measure(target: Target, workload: str, batch: int, concurrency: int, n: int) -> Cell:
    items = texts(workload, n, offset=1000 * batch + concurrency)
    requests = [items[i : i + batch] for i in range(0, n, batch)]
    clients = [httpx.Client(base_url=target.url, timeout=600) for _ in range(concurrency)]
    try:
        embed(clients[0], target, texts(workload, batch, offset=7))  # warm-up
        latencies: list[float] = []
        tokens = 0

        def run(k: int) -> None:
            nonlocal tokens
            for req in requests[k::concurrency]:
                t0 = time.perf_counter()
                out = embed(clients[k], target, req)
                latencies.append(time.perf_counter() - t0)
                assert len(out["data"]) == len(req)
                tokens += out["usage"]["prompt_tokens"]

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(run, range(concurrency)))
        seconds = time.perf_counter() - start
    finally:
        for c in clients:
            c.close()
    return Cell(target.label, workload, batch, concurrency, n, seconds, tokens,
                statistics.median(latencies))  # fmt: skip


def agreement(a: Target, b: Target, workload: str) -> float:
    """The lowest cosine similarity between the two servers' vectors for the same inputs."""
    batch = texts(workload, 8, offset=42)
    with (
        httpx.Client(base_url=a.url, timeout=600) as ca,
        httpx.Client(base_url=b.url, timeout=600) as cb,
    ):  # noqa: E501
        va = np.array([d["embedding"] for d in embed(ca, a, batch)["data"]])
        vb = np.array([d["embedding"] for d in embed(cb, b, batch)["data"]])
    cos = (va * vb).sum(1) / (np.linalg.norm(va, axis=1) * np.linalg.norm(vb, axis=1))
    return float(cos.min())


def embedding_folder(size: str) -> Path:
    """Random weights in the shapes of `size`, written once under the user cache dir."""
    from mlx_prefix.embeddings.testing import make_embedding_test_model

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx-prefix"
    folder = root / f"bench-embedding-{size}"
    if not (folder / "model.safetensors").is_file():
        make_embedding_test_model(folder, size=size)
    return folder


@contextmanager
def our_server(folder: Path, log_dir: Path):
    """`mlx-prefix serve` with `folder` as its --embedding-model, until the block ends."""
    from mlx_prefix.models.testing import cached_test_model

    port = free_port()
    cmd = [sys.executable, "-m", "mlx_prefix", "serve", "--model", str(cached_test_model("dense")),
           "--embedding-model", str(folder), "--port", str(port), "--disk-cache", "off",
           "--no-prefetch", "--log-level", "warning"]  # fmt: skip
    log = open(log_dir / "mlx-prefix.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                httpx.get(url + "/health", timeout=5).raise_for_status()
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlx-prefix did not start: see {log.name}") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def table(cells: list[Cell]) -> str:
    lines = [
        "| server | workload | batch | clients | inputs/s | tokens/s | p50 request |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c.server} | {c.workload} | {c.batch} | {c.concurrency} | {c.inputs_per_s:.2f} "
            f"| {c.tokens_per_s:.0f} | {c.p50_request_s * 1000:.0f} ms |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running mlx-prefix server (default: start one)")
    p.add_argument("--model", help="the `model` our server is asked for (default: its id)")
    p.add_argument("--embedding-model", type=Path, help="folder for the server we start")
    p.add_argument("--size", default="qwen3-0.6b", help="random-weight shapes when no folder")
    p.add_argument("--peer-url", help="a second server's base URL (without /v1)")
    p.add_argument("--peer-model", help="the `model` the peer wants (vllm-mlx: its path)")
    p.add_argument("--peer-label", default="peer")
    p.add_argument("--workloads", default="short,long")
    p.add_argument("--batch", default="1,16", help="inputs per request, comma-separated")
    p.add_argument("--concurrency", default="1,4", help="client threads, comma-separated")
    p.add_argument("--inputs", type=int, default=64, help="inputs per cell")
    p.add_argument("--check", action="store_true", help="compare the two servers' vectors")
    p.add_argument("--out", type=Path, help="write the cells as JSON here")
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    if any(w not in WORKLOADS for w in workloads):
        p.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    batches = [int(b) for b in args.batch.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]

    with ExitStack() as stack:
        url = args.url
        folder = args.embedding_model
        if url is None:
            folder = folder or embedding_folder(args.size)
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            url = stack.enter_context(our_server(folder, log_dir))
        model = args.model or httpx.get(url + "/v1/models").json()["data"][-1]["id"]
        targets = [Target("mlx-prefix", url, model)]
        if args.peer_url:
            peer_model = args.peer_model or (str(folder) if folder else model)
            targets.append(Target(args.peer_label, args.peer_url.rstrip("/"), peer_model))
        print(table([]), flush=True)
        cells = []
        for w in workloads:
            for b in batches:
                requests = -(-args.inputs // b)
                for c in concurrency:
                    if c > requests and c != min(concurrency):
                        continue  # more clients than requests: the same as fewer
                    for t in targets:  # interleaved: the machine's load falls on both
                        cells.append(measure(t, w, b, c, args.inputs))
                        print(table(cells[-1:]).splitlines()[-1], flush=True)
        check = None
        if args.check and len(targets) == 2:
            check = {w: agreement(targets[0], targets[1], w) for w in workloads}
            print("lowest cosine between the servers' vectors:", check)
    if args.out:
        rows = [asdict(c) | {"inputs_per_s": c.inputs_per_s, "tokens_per_s": c.tokens_per_s}
                for c in cells]  # fmt: skip
        args.out.write_text(json.dumps({"cells": rows, "agreement": check}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
