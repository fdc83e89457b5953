"""What every workload shares: result records, reuse accounting, cold-run checks.

A workload is a module with `NAME`, `TITLE`, `ASKED` (the size the issue asks for),
`describe(sizes) -> str` (the sizes it runs at, for RESULTS.md), and one of
  `async def run(ctx, server, client) -> ServerResult`  (once per server, shared servers),
  `def run_standalone(ctx) -> dict[str, ServerResult]`  (starts its own processes), or
  `def run_once(sizes, model) -> dict[str, ServerResult]`  (in-process, once per run).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from .client import Reply, Request, send
from .models import BenchModel, Tokens
from .profiles import Sizes
from .servers import OURS, PEER, Server, ServerSpec, new_server


@dataclass(slots=True)
class Sample:
    """One measured request."""

    label: str  # "turn 3", "burst warm #2", ...
    prompt_tokens: int | None
    cached_tokens: int | None  # as the server reported it (None: not reported)
    novel_tokens: int | None  # prompt tokens no earlier request to this server computed
    completion_tokens: int | None
    ttft_s: float | None
    total_s: float
    text: str  # greedy output, for the warm/cold comparison
    group: str = ""  # requests measured together (a burst) share a group
    gaps_s: list[float] = field(default_factory=list)  # inter-token latency, see Reply
    retries: int = 0  # connections the server dropped before answering (see client.send)


def itl(samples: list[Sample]) -> dict[str, Any]:
    """Inter-token latency pooled over requests: every gap between two output chunks of
    the same request counts once. p99 of a few dozen gaps is close to their maximum."""
    gaps = np.asarray([g for s in samples for g in s.gaps_s], dtype=np.float64)
    if not len(gaps):
        return {"gaps": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    p50, p99 = (float(x) for x in np.percentile(gaps, [50, 99]) * 1000)
    return {"gaps": len(gaps), "p50_ms": p50, "p99_ms": p99, "max_ms": float(gaps.max()) * 1000}


@dataclass(slots=True)
class Check:
    """A warm request's output against the same request computed cold."""

    label: str
    match: bool
    warm: str
    cold: str
    how: str  # "prefix_cache disabled" | "fresh process, no prompt cache"


@dataclass(slots=True)
class ServerResult:
    server: str
    samples: list[Sample] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    wall_s: float = 0.0  # the workload's measured requests, end to end
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # workload-specific series
    # Prompt tokens the server prefilled off the requests' path (mlx-prefix's next-turn
    # prefetch, read from /v1/cache): still prefill work, so part of `prefilled`.
    background_tokens: int = 0

    def reuse(self) -> dict[str, Any]:
        """Prefilled vs novel tokens. efficiency = novel / prefilled (1.0: nothing
        recomputed; 0.25: four times the necessary prefill), counting background prefill;
        request_path_efficiency leaves it out (what the requests waited for). Raw values:
        above 1.0 the server reported more cached tokens than it can have computed
        (`over_reported`: by how many tokens), which is a measurement error, not reuse."""
        rows = [s for s in self.samples if s.prompt_tokens is not None and s.novel_tokens]
        novel = sum(s.novel_tokens or 0 for s in rows)
        if not rows or any(s.cached_tokens is None for s in rows):
            return {"prefilled": None, "novel": novel or None, "efficiency": None}
        on_path = sum((s.prompt_tokens or 0) - (s.cached_tokens or 0) for s in rows)
        prefilled = on_path + self.background_tokens
        return {
            "prefilled": prefilled,
            "background": self.background_tokens,
            "novel": novel,
            "efficiency": novel / prefilled if prefilled else None,
            "request_path_efficiency": novel / on_path if on_path else None,
            "over_reported": max(0, novel - prefilled),
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reuse"] = self.reuse()
        out["checks_matched"] = sum(c.match for c in self.checks)
        return out


@dataclass(slots=True)
class WorkloadResult:
    workload: str
    title: str
    model: str
    servers: dict[str, ServerResult]
    skipped: str | None = None  # why, when the workload could not run
    elapsed_s: float = 0.0  # all of it: server starts and cold-run checks included

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "title": self.title,
            "model": self.model,
            "skipped": self.skipped,
            "elapsed_s": self.elapsed_s,
            "servers": {k: v.to_json() for k, v in self.servers.items()},
        }


class Ledger:
    """Token sequences a server has computed (prompts plus generated replies), to count
    the tokens of a new prompt that no earlier request computed."""

    def __init__(self) -> None:
        self._seqs: list[np.ndarray] = []

    def common(self, tokens: list[int]) -> int:
        """The longest prefix of `tokens` some earlier sequence shares."""
        a = np.asarray(tokens, dtype=np.int64)
        best = 0
        for s in self._seqs:
            n = min(len(a), len(s))
            diff = np.flatnonzero(a[:n] != s[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return best

    def novel(self, tokens: list[int]) -> int:
        return max(1, len(tokens) - self.common(tokens))  # at least one token is computed

    def add(self, tokens: list[int]) -> None:
        self._seqs.append(np.asarray(tokens, dtype=np.int64))


@dataclass
class Context:
    """One model's run: its servers, its sizes, and the helpers workloads call."""

    sizes: Sizes
    model: BenchModel
    tokens: Tokens
    out_dir: Path
    servers: dict[str, Server]  # OURS, PEER (and VLLM): started with default cache settings
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    _peer_cold: Server | None = None
    log: Callable[[str], None] = print

    def ledger(self, server: str) -> Ledger:
        return self.ledgers.setdefault(server, Ledger())

    def prompt_ids(self, request: Request) -> list[int]:
        if request.messages is not None:
            return self.tokens.chat(request.messages, request.tools)
        return self.tokens.text(request.prompt or "")

    def account(
        self,
        server: str,
        label: str,
        request: Request,
        reply: Reply,
        group: str = "",
        ledger: Ledger | None = None,
    ) -> Sample:
        """Turn a reply into a Sample, counting its novel tokens against `ledger`
        (default: the server's run-wide ledger), then record what it computed."""
        ledger = ledger or self.ledger(server)
        ids = self.prompt_ids(request)
        novel = ledger.novel(ids)
        ledger.add(ids + self.tokens.text(reply.text))
        return Sample(
            label,
            reply.prompt_tokens,
            reply.cached_tokens,
            novel,
            reply.completion_tokens,
            reply.ttft_s,
            reply.total_s,
            reply.text,
            group,
            reply.gaps_s,
            reply.retries,
        )

    def peer_cold(self) -> Server:
        """An mlx_lm.server that keeps no prompt cache: every request runs cold (on as
        many ranks as the measured servers)."""
        if self._peer_cold is None:
            args = ("--prompt-cache-size", "0")
            spec = ServerSpec(PEER, self.model.path, args, "peer-cold", self.model.ranks)
            self._peer_cold = new_server(spec, self.out_dir / "logs").start()
        return self._peer_cold

    async def cold(self, client: httpx.AsyncClient, server: Server, request: Request) -> Reply:
        if server.name == OURS:
            return await send(client, server, request, cold=True)
        return await send(client, self.peer_cold(), request)

    async def check(
        self,
        client: httpx.AsyncClient,
        server: Server,
        result: ServerResult,
        label: str,
        request: Request,
        warm: Reply,
    ) -> None:
        cold = await self.cold(client, server, request)
        how = {
            OURS: "prefix_cache disabled",
            PEER: "fresh process, no prompt cache",
        }.get(server.name, "a fresh mlx_lm.server with no prompt cache")  # vllm-mlx: no switch
        result.checks.append(Check(label, warm.text == cold.text, warm.text, cold.text, how))

    async def check_warm(
        self,
        client: httpx.AsyncClient,
        server: Server,
        result: ServerResult,
        sent: list[tuple[str, Request, Reply]],
    ) -> None:
        """Cold twins for the requests after the first (the warm ones), as should_check
        picks them."""
        warm = sent[1:]
        for i, (label, request, reply) in enumerate(warm):
            if self.should_check(i, len(warm)):
                await self.check(client, server, result, label, request, reply)

    def should_check(self, index: int, count: int) -> bool:
        """Which warm requests get a cold twin: all (full) or the last `check_last`."""
        return self.sizes.check_last is None or index >= count - self.sizes.check_last

    def close(self) -> None:
        if self._peer_cold is not None:
            self._peer_cold.stop()
            self._peer_cold = None


async def timed(coro_fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = await coro_fn()
    return out, time.perf_counter() - t


def run_async(fn: Callable[[httpx.AsyncClient], Any]) -> Any:
    async def main() -> Any:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(limits=limits, timeout=None) as client:
            return await fn(client)

    return asyncio.run(main())
