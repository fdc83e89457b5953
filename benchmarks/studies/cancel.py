"""Cancel, then resend; and a client that retries on a timeout (issue 55 item 1).

For each server in turn (mlx-prefix, mlx_lm.server, vllm-mlx where `make peers`
installed it; each alone on the box): a cold request measures the prefill of a prompt of
`--tokens` tokens (a passage of the KJV as the system prompt). *Cancel and resend*: a
second prompt of the same length is sent and the client closes its connection at
`--cancel-at` (0.5) of that cold time, as Esc or a timeout does; after `--pause` seconds
the same prompt is sent again. *Retry*: a third prompt of the same length, sent by a
client whose timeout is `--timeout-share` (0.4) of the cold time (the issue's 60 s
against a 150 s prefill), which closes the connection at its timeout and sends the
same request again after `--retry-pause` seconds, up to `--max-tries`: its tries, their
total time and the tokens each try reused. Cached tokens are the servers' usage
(prompt_tokens_details.cached_tokens); vllm-mlx reports none, so its log's
`[cache_fetch]` lines give them, one per request that reached its cache (a try closed
before it did has none). A try that timed out has no usage: mlx-prefix's log line for
it says its cached tokens, mlx_lm.server logs none (only its finishing try's shows).
Memory only (mlx-prefix: `--disk-cache off`, as the harness starts it). Writes
benchmarks/out/cancel-<model>.json and renders benchmarks/results/standalone/cancel55.md
from those found.

`python -m mlx_prefix.blas_exec python -m benchmarks.studies.cancel [--model hybrid] [--quick]`
(`--only mlx-prefix --ours-args=--no-finish-cancelled`: what the stored point alone gives)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ..client import Reply, Request, send
from ..corpus import passage
from ..models import Tokens, resolve
from ..names import OURS, PEER, VLLM
from ..server_process import Server
from ..servers import unavailable
from .budgets import machine_line, runs_when, start
from .shared_prefix_memory.sessions import vllm_cached_from

QUESTION = "In one sentence: who speaks first in this passage?"
OUT = Path(__file__).resolve().parents[1] / "out"
STANDALONE = Path(__file__).resolve().parents[1] / "results" / "standalone" / "cancel55.md"
TOKENS = {"dense": 1500, "hybrid": 3000}  # a prefill of some seconds on a 2-core CPU


def _request(system: str, max_tokens: int = 4) -> Request:
    return Request(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
    )


async def _abandon(client: httpx.AsyncClient, server: Server, request: Request, after_s: float):
    """Send `request` streaming and close the connection after `after_s` seconds (or
    when it ends first): the server sees the client go. Returns the reply if it ended
    in time, else None."""
    try:
        async with asyncio.timeout(after_s):
            return await send(client, server, request)
    except TimeoutError:
        return None


OURS_LINE = re.compile(r"/v1/chat/completions prompt=\d+ cached=(\d+|-)")


def ours_cached_from(log: Path) -> list[int | None]:
    """mlx-prefix's cached tokens per chat request, in the order they ended, from its
    log's request lines (a request closed by its client is logged too; `-`: None)."""
    found = OURS_LINE.findall(log.read_text(errors="replace"))
    return [None if c == "-" else int(c) for c in found]


class Fetches:
    """Cached tokens per request, from the server's log: vllm-mlx's `[cache_fetch]`
    lines, mlx-prefix's request lines; mlx_lm.server logs none."""

    def __init__(self, server: Server):
        self.server = server
        self.seen = len(self.all())

    def all(self) -> list[int | None]:
        log = Path(getattr(self.server._log, "name", ""))
        if self.server.name == VLLM:
            return list(vllm_cached_from(log))
        return ours_cached_from(log) if self.server.name == OURS else []

    def new(self) -> list[int | None]:
        """Cached tokens of the requests that reached the cache since the last call."""
        now = self.all()
        out, self.seen = now[self.seen :], len(now)
        return out


def _cached(reply: Reply | None, fetched: list[int | None]) -> int | None:
    if fetched and fetched[-1] is not None:
        return fetched[-1]
    return reply.cached_tokens if reply is not None else None


async def _one_server(server: Server, prompts: list[str], args: argparse.Namespace):
    first, second, third = prompts
    async with httpx.AsyncClient() as client:
        fetches = Fetches(server)
        cold = await send(client, server, _request(first))
        fetches.new()
        cold_s = cold.ttft_s or cold.total_s
        started = time.perf_counter()
        await _abandon(client, server, _request(second), args.cancel_at * cold_s)
        abandoned_s = time.perf_counter() - started
        await asyncio.sleep(args.pause)
        fetches.new()
        resend = await send(client, server, _request(second))
        resend_cached = _cached(resend, fetches.new())
        # The retrying client: the same request again at each timeout.
        timeout_s = args.timeout_share * cold_s
        tries: list[dict[str, Any]] = []
        started = time.perf_counter()
        reply = None
        while reply is None and len(tries) < args.max_tries:
            if tries:
                await asyncio.sleep(args.retry_pause)
            t0 = time.perf_counter()
            reply = await _abandon(client, server, _request(third), timeout_s)
            tries.append({"s": time.perf_counter() - t0, "done": reply is not None})
        total_s = time.perf_counter() - started
        await asyncio.sleep(1.0)  # let vllm-mlx's log catch up with the last try
        # The tries' lines are the last ones: mlx-prefix logs a request when it ends, so
        # the resend's line may come after the read above.
        fetched = fetches.new()[-len(tries) :]
        unknown: list[int | None] = [None] * (len(tries) - len(fetched))
        fetched = unknown + fetched
        for t, cached in zip(tries, fetched, strict=True):
            t["cached_tokens"] = cached
        if reply is not None and server.name != VLLM:  # its usage, whatever its log said
            tries[-1]["cached_tokens"] = reply.cached_tokens
    return {
        "prompt_tokens": resend.prompt_tokens,
        "cold_ttft_s": cold_s,
        "cancelled_after_s": abandoned_s,
        "resend_cached_tokens": resend_cached,
        "resend_ttft_s": resend.ttft_s,
        "resend_total_s": resend.total_s,
        "retry": {
            "timeout_s": timeout_s,
            "tries": tries,
            "finished": reply is not None,
            "total_s": total_s,
            "prompt_tokens": reply.prompt_tokens if reply is not None else None,
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense", help="dense (bundled SmolLM2) | hybrid | folder")
    p.add_argument("--tokens", type=int, help="system prompt tokens (dense 1500, hybrid 3000)")
    p.add_argument("--cancel-at", type=float, default=0.5, help="share of the cold prefill")
    p.add_argument("--pause", type=float, default=2.0, help="seconds before the resend")
    p.add_argument("--timeout-share", type=float, default=0.4, help="retry: timeout / cold")
    p.add_argument("--max-tries", type=int, default=8, help="retry: give up after these")
    p.add_argument("--retry-pause", type=float, default=0.5, help="retry: seconds between")
    p.add_argument("--ours-args", default="", help="more flags for mlx-prefix serve")
    p.add_argument("--only", choices=(OURS, PEER, VLLM), help="run this server alone")
    p.add_argument("--quick", action="store_true", help="a third of the tokens")
    p.add_argument("--json", type=Path, help="where to write the results (out/cancel-MODEL)")
    p.add_argument("--render", action="store_true", help="only rewrite the table")
    args = p.parse_args(argv)
    if args.render:
        STANDALONE.write_text(render())
        return {}
    model = resolve(args.model)
    n = args.tokens or TOKENS.get(args.model, TOKENS["dense"])
    n = n // 3 if args.quick else n
    count = Tokens(model.path).count
    prompts = [passage(100, n, count), passage(9000, n, count), passage(18000, n, count)]
    results: dict[str, Any] = {
        "model": args.model, "description": model.description, "tokens": n,
        "machine": machine_line(), "timeout_share": args.timeout_share,
        "cancel_at": args.cancel_at, "servers": {}, "left_out": {},
    }  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="bench-cancel-"))
    for name in (args.only,) if args.only else (OURS, PEER, VLLM):
        if (why := unavailable(name)) is not None:
            results["left_out"][name] = why
            print(f"{name:>14}: left out: {why}", flush=True)
            continue
        extra = tuple(args.ours_args.split()) if name == OURS else ()
        started = machine_line()
        server = start(name, model.path, None, log_dir, name, extra=extra)
        try:
            r = results["servers"][name] = asyncio.run(_one_server(server, prompts, args))
            r["machine"] = started
            _save(args, results)  # a run cut short keeps the servers it measured
        finally:
            server.stop()
        tries = r["retry"]["tries"]
        print(
            f"{name:>14}: cold TTFT {r['cold_ttft_s']:.1f} s; cancelled after "
            f"{r['cancelled_after_s']:.1f} s; resend reused {r['resend_cached_tokens']} of "
            f"{r['prompt_tokens']} tokens, TTFT {r['resend_ttft_s']:.1f} s; retry at "
            f"{r['retry']['timeout_s']:.1f} s: {len(tries)} tries, "
            f"{'finished' if r['retry']['finished'] else 'NOT finished'} in "
            f"{r['retry']['total_s']:.1f} s",
            flush=True,
        )
    _save(args, results)
    if args.json is None:
        STANDALONE.write_text(render())
    return results


def _save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    results["machine_end"] = machine_line()
    path = args.json or OUT / f"cancel-{args.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_merged(path, results), indent=2) + "\n")


def _merged(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc`, keeping from the same measure's earlier file the servers it did not run
    (a peer run on its own later, e.g. once `make peers` installed it)."""
    if not path.is_file():
        return doc
    old = json.loads(path.read_text())
    if (old.get("tokens"), old.get("model")) != (doc["tokens"], doc["model"]):
        return doc
    ran = set(doc["servers"]) | set(doc["left_out"])
    servers = {n: r for n, r in old["servers"].items() if n not in ran} | doc["servers"]
    left_out = {n: w for n, w in old["left_out"].items() if n not in servers}
    left_out.update({n: w for n, w in doc["left_out"].items() if n not in servers})
    return {**doc, "servers": servers, "left_out": left_out}


def _n(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def render() -> str:
    """The markdown section of the runs in benchmarks/out/cancel-*.json."""
    lines = [
        "## A cancelled prefill keeps its work (issue 55 item 1)",
        "",
        "`benchmarks/studies/cancel.py`: each server alone, memory only, greedy, 4 tokens a "
        "reply. *Resend*: a prompt cancelled by the client at half its cold prefill time, "
        "sent again 2 s later (goal: reuses >= 95% of the tokens computed before the "
        "cancel). *Retry*: a client whose timeout is 0.4 of the cold prefill (60 s against "
        "150 s), sending the same request again 0.5 s after each timeout (goal: finishes "
        "within four tries). *reused per try*: cached tokens each try reported "
        "(a try that timed out: from mlx-prefix's and vllm-mlx's logs; mlx_lm.server logs "
        "none; `-`: not known).",
    ]
    for path in sorted(OUT.glob("cancel-*.json")):
        doc = json.loads(path.read_text())
        when = runs_when((n, r.get("machine", doc["machine"])) for n, r in doc["servers"].items())
        lines += [
            "",
            f"**{doc['model']}** ({doc['description']}), a {doc['tokens']:,}-token system "
            f"prompt; {when}.",
            "",
            "| server | cold TTFT s | cancelled after s | resend: reused of prompt | resend "
            "TTFT s | retry timeout s | tries | finished | total s | reused per try |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
        ]
        for name, r in doc["servers"].items():
            t = r["retry"]
            per_try = ", ".join(_n(x["cached_tokens"]) for x in t["tries"])
            lines.append(
                f"| {name} | {r['cold_ttft_s']:.1f} | {r['cancelled_after_s']:.1f} | "
                f"{_n(r['resend_cached_tokens'])} of {_n(r['prompt_tokens'])} | "
                f"{r['resend_ttft_s']:.1f} | {t['timeout_s']:.1f} | {len(t['tries'])} | "
                f"{'yes' if t['finished'] else '**no**'} | {t['total_s']:.1f} | {per_try} |"
            )
        lines += [f"- {n} left out: {w}." for n, w in doc.get("left_out", {}).items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
