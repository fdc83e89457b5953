"""Issue 33's throughput, on every server of the run and on mlx-prefix `--deterministic`:

- requests/s at 4, 8 and 16 concurrent clients, each client sending its requests one
  after another: once with a system prompt every request shares ("shared"), once where
  each request brings its own text of the same length and no system prompt ("unique",
  where no cache can help and only batching counts);
- a warm burst: one request reads an instruction, then 6 requests sharing it arrive at
  once, each with its own snippet: the burst's wall time and the inter-token latency
  pooled over its requests;
- single-stream decode: one request, decode tokens/s measured between its first and last
  output chunk, beside `mlx_lm.generate` on the same model and prompt (a fresh process
  under the same fast BLAS; the rate it prints).

Each measure records the completion tokens, so ratios compare like with like. The
batch-invariant mode runs in its own process after the shared servers, where `mlx-prefix
serve --help` lists `--deterministic`; otherwise its row says why it is missing.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import traceback

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult, itl, run_async
from ..names import GENERATE, OURS, OURS_DETERMINISTIC
from ..profiles import Sizes
from ..servers import DETERMINISTIC, Server, ServerSpec, has_flag

NAME = "throughput"
TITLE = "Throughput: requests/s, warm burst, decode"
ASKED = (
    "4, 8 and 16 clients with and without a shared system prompt; warm 6-way burst; "
    "single-stream decode against mlx_lm.generate"
)
_OFFSET = 22500
VARIANTS = ("shared", "unique")  # extra keys: f"{variant}_rps_{clients}", ...
DECODE_PROMPT = (
    "Tell a long story about a lighthouse keeper who finds a message in a bottle. "
    "Describe every room of the lighthouse."
)


def describe(s: Sizes) -> str:
    clients = "/".join(str(c) for c in s.throughput_clients)
    return (
        f"{clients} clients x {s.throughput_requests_per_client} requests, "
        f"{s.throughput_prompt_tokens}-token system prompt shared or text of its own, "
        f"{s.throughput_max_tokens}-token replies; warm burst of {s.throughput_burst_size} "
        f"on a {s.throughput_burst_instruction_tokens}-token instruction; "
        f"{s.throughput_decode_tokens}-token single-stream decode"
    )


def _request(ctx: Context, variant: str, serial: int) -> Request:
    p, count = ctx.sizes, ctx.tokens.count
    question = f"Request {serial}: what is the passage about, in one sentence?"
    if variant == "shared":
        system = "You answer questions about this text, briefly.\n\n" + passage(
            _OFFSET, p.throughput_prompt_tokens, count
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    else:  # the same length, its own from the first token on
        text = passage(_OFFSET + 300 + 5 * serial, p.throughput_prompt_tokens, count)
        messages = [{"role": "user", "content": f"Text {serial}:\n\n{text}\n\n{question}"}]
    return Request(messages=messages, max_tokens=p.throughput_max_tokens)


async def _levels(
    ctx: Context, key: str, server: Server, client: httpx.AsyncClient, res: ServerResult
) -> list:
    """Every client count, both variants; returns the last shared-prompt request sent
    (label, request, reply), for its cold twin."""
    p = ctx.sizes
    serial = 0
    last: list = []
    for variant in VARIANTS:
        for clients in p.throughput_clients:
            group = f"{variant} {clients}"

            async def one_client(group: str = group, variant: str = variant) -> None:
                nonlocal serial
                for _ in range(p.throughput_requests_per_client):
                    serial += 1
                    req = _request(ctx, variant, serial)
                    reply = await send(client, server, req)
                    res.samples.append(ctx.account(key, group, req, reply, group=group))
                    if variant == "shared":
                        last[:] = [group, req, reply]

            t = time.perf_counter()
            await asyncio.gather(*(one_client() for _ in range(clients)))
            wall = time.perf_counter() - t
            level = [s for s in res.samples if s.group == group]
            res.extra[f"{variant}_rps_{clients}"] = len(level) / wall
            tokens = sum(s.completion_tokens or 0 for s in level)
            res.extra[f"{variant}_completion_tokens_{clients}"] = tokens
            res.extra["itl"][group] = itl(level)
    return last


def _burst_requests(ctx: Context) -> list[Request]:
    p, count = ctx.sizes, ctx.tokens.count
    instruction = (
        "You are a browser extension's summarizer. Reply to each snippet with one plain "
        "sentence. Notes on the collection the snippets come from:\n\n"
        + passage(_OFFSET + 1200, p.throughput_burst_instruction_tokens, count)
    )
    return [
        Request(
            messages=[
                {"role": "system", "content": instruction},
                {
                    "role": "user",
                    "content": "Snippet: "
                    + passage(_OFFSET + 1500 + 40 * i, p.throughput_burst_item_tokens, count),
                },
            ],
            max_tokens=p.throughput_max_tokens,
        )
        for i in range(p.throughput_burst_size + 1)  # the first one primes the instruction
    ]


async def _warm_burst(
    ctx: Context, key: str, server: Server, client: httpx.AsyncClient, res: ServerResult
) -> None:
    prime, *burst = _burst_requests(ctx)
    reply = await send(client, server, prime)
    res.samples.append(ctx.account(key, "burst prime", prime, reply, group="prime"))
    t = time.perf_counter()
    replies = await asyncio.gather(*(send(client, server, r) for r in burst))
    res.extra["warm_burst_wall_s"] = time.perf_counter() - t
    res.extra["warm_burst_completion_tokens"] = sum(r.completion_tokens or 0 for r in replies)
    for i, (req, reply) in enumerate(zip(burst, replies, strict=True)):
        res.samples.append(ctx.account(key, f"burst #{i + 1}", req, reply, group="burst"))
    res.extra["itl"]["burst"] = itl([s for s in res.samples if s.group == "burst"])


def decode_request(sizes: Sizes) -> Request:
    return Request(
        messages=[{"role": "user", "content": DECODE_PROMPT}],
        max_tokens=sizes.throughput_decode_tokens,
    )


async def _decode(
    ctx: Context, key: str, server: Server, client: httpx.AsyncClient, res: ServerResult
) -> None:
    req = decode_request(ctx.sizes)
    reply = await send(client, server, req)
    res.samples.append(ctx.account(key, "single stream", req, reply, group="decode"))
    t = reply.chunk_times
    n = reply.completion_tokens or 0
    # From the first output chunk to the last: decode alone, the prompt's prefill left out.
    res.extra["decode_tokens"] = n
    res.extra["decode_tps"] = (n - 1) / (t[-1] - t[0]) if n > 1 and len(t) > 1 else None


async def measure(
    ctx: Context, key: str, server: Server, client: httpx.AsyncClient
) -> ServerResult:
    """Every measure on one server; results and reuse ledgers are keyed on `key`."""
    res = ServerResult(key)
    res.extra["itl"] = {}
    start = time.perf_counter()
    last = await _levels(ctx, key, server, client, res)
    await _warm_burst(ctx, key, server, client, res)
    await _decode(ctx, key, server, client, res)
    res.wall_s = time.perf_counter() - start
    dropped = sum(s.retries for s in res.samples)
    if dropped:  # their time is in the figures: a retried request waited for both tries
        res.notes.append(f"{dropped} connections dropped before an answer, sent again")
    if last:  # a batched reply against the same request served cold
        await ctx.check(client, server, res, *last)
    return res


def _deterministic(ctx: Context) -> ServerResult:
    if not has_flag(DETERMINISTIC):
        why = f"not run: `mlx-prefix serve --help` lists no {DETERMINISTIC}"
        return ServerResult(OURS_DETERMINISTIC, notes=[why])
    spec = ServerSpec(OURS, ctx.model.path, (DETERMINISTIC,), "ours-deterministic")
    server = Server(spec, ctx.out_dir / "logs").start()
    try:
        return run_async(lambda c: measure(ctx, OURS_DETERMINISTIC, server, c))
    finally:
        server.stop()


GENERATION = re.compile(r"Generation:\s*(\d+) tokens,\s*([\d.]+) tokens-per-sec")


def generate_reference(ctx: Context) -> ServerResult:
    """`mlx_lm.generate` on the decode request: the tokens/s it reports for generation."""
    res = ServerResult(GENERATE)
    py = sys.executable
    cmd = [py, "-m", "mlx_prefix.blas_exec", py, "-m", "mlx_lm", "generate",
           "--model", str(ctx.model.path), "--prompt", DECODE_PROMPT,
           "--max-tokens", str(ctx.sizes.throughput_decode_tokens), "--temp", "0.0"]  # fmt: skip
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    res.wall_s = time.perf_counter() - t
    found = GENERATION.search(out.stdout + out.stderr)
    if out.returncode != 0 or found is None:
        res.notes.append(f"error: mlx_lm.generate exited {out.returncode}: {out.stderr[-300:]}")
        return res
    res.extra["decode_tokens"] = int(found.group(1))
    res.extra["decode_tps"] = float(found.group(2))
    return res


def run_standalone(ctx: Context) -> dict[str, ServerResult]:
    out: dict[str, ServerResult] = {}
    for server in ctx.servers.values():
        try:
            out[server.name] = run_async(lambda c, s=server: measure(ctx, s.name, s, c))
        except Exception as e:  # one server's failure leaves the others' rows
            traceback.print_exc()
            ctx.log(f"  {server.name} failed: {e!r}")
            out[server.name] = ServerResult(server.name, notes=[f"error: {e!r}"])
    try:
        out[OURS_DETERMINISTIC] = _deterministic(ctx)
    except Exception as e:
        traceback.print_exc()
        ctx.log(f"  {OURS_DETERMINISTIC} failed: {e!r}")
        out[OURS_DETERMINISTIC] = ServerResult(OURS_DETERMINISTIC, notes=[f"error: {e!r}"])
    out[GENERATE] = generate_reference(ctx)
    return out
