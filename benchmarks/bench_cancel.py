"""Cancel, then resend (issue 55): what a client that gives up on a prefill gets back.

For each server in turn (mlx-prefix, then mlx_lm.server; each alone on the box): a cold
request measures the prefill of a ~1.5K-token prompt (one passage of the KJV as the
system prompt); then a second prompt of the same length (another passage) is sent and the
client closes its connection at `--cancel-at` (0.5) of that cold time, as Esc or a
timeout does; after `--pause` seconds the same prompt is sent again. Reported: the
tokens the resend reused (usage.prompt_tokens_details.cached_tokens, which both servers
report), its time to first token and its whole time, beside the cold run's. Memory only
(mlx-prefix: `--disk-cache off`, as the harness starts it).

`python -m mlx_prefix.blas_exec python -m benchmarks.bench_cancel [--tokens 1500] [--json FILE]`
(`--only mlx-prefix --ours-args=--no-finish-cancelled`: what the stored point alone gives)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from .client import Request, send
from .corpus import passage
from .models import Tokens, resolve
from .names import OURS, PEER
from .server_process import ServerSpec
from .servers import start_all

QUESTION = "In one sentence: who speaks first in this passage?"


def _request(system: str, max_tokens: int = 4) -> Request:
    return Request(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
    )


async def _abandon(client: httpx.AsyncClient, url: str, request: Request, after_s: float) -> None:
    """Send `request` streaming and close the connection after `after_s` seconds (or
    when it ends first): the server sees the client go."""
    path, body = request.body()
    try:
        async with asyncio.timeout(after_s):
            async with client.stream("POST", url + path, json=body, timeout=None) as resp:
                async for _ in resp.aiter_lines():
                    pass
    except TimeoutError:
        pass


async def _one_server(url: str, first: str, second: str, cancel_at: float, pause_s: float):
    async with httpx.AsyncClient() as client:
        cold = await send(client, url, _request(first))
        after = cancel_at * (cold.ttft_s or cold.total_s)
        started = time.perf_counter()
        await _abandon(client, url, _request(second), after)
        abandoned_s = time.perf_counter() - started
        await asyncio.sleep(pause_s)
        resend = await send(client, url, _request(second))
    return cold, abandoned_s, resend


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense", help="dense (bundled SmolLM2) | hybrid | folder")
    p.add_argument("--tokens", type=int, default=1500, help="system prompt tokens (1500)")
    p.add_argument("--cancel-at", type=float, default=0.5, help="share of the cold prefill")
    p.add_argument("--pause", type=float, default=2.0, help="seconds before the resend")
    p.add_argument("--ours-args", default="", help="more flags for mlx-prefix serve")
    p.add_argument("--only", choices=(OURS, PEER), help="run this server alone")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    model = resolve(args.model)
    count = Tokens(model.path).count
    first, second = passage(100, args.tokens, count), passage(9000, args.tokens, count)
    results: dict[str, Any] = {"model": model.description, "tokens": args.tokens}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-cancel-"))
    for name in (args.only,) if args.only else (OURS, PEER):
        extra = tuple(args.ours_args.split()) if name == OURS else ()
        spec = ServerSpec(name, model.path, extra_args=extra, label=name)
        (server,) = start_all([spec], log_dir)
        try:
            cold, abandoned_s, resend = asyncio.run(
                _one_server(server.url, first, second, args.cancel_at, args.pause)
            )
        finally:
            server.stop()
        results[name] = {
            "prompt_tokens": resend.prompt_tokens,
            "cold_ttft_s": cold.ttft_s,
            "cancelled_after_s": abandoned_s,
            "resend_cached_tokens": resend.cached_tokens,
            "resend_ttft_s": resend.ttft_s,
            "resend_total_s": resend.total_s,
        }
        r = results[name]
        print(
            f"{name:>14}: cold TTFT {cold.ttft_s:.1f} s; cancelled after {abandoned_s:.1f} s; "
            f"resend reused {resend.cached_tokens} of {resend.prompt_tokens} tokens, "
            f"TTFT {r['resend_ttft_s']:.1f} s",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
