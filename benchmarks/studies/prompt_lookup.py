"""Prompt lookup decoding (--prompt-lookup / a request's prompt_lookup): decode tokens/s
with lookup on and off in one engine, at 1 and 4 streams, the acceptance, and whether
each reply equals plain decoding's; mlx_lm.server and vllm-mlx (when they can start
here) decode the same requests plainly in the same run, over HTTP.

On the default model (SmolLM2-135M-Instruct), three workloads (issue 54):
  edit     an edit tool call: the prompt holds a file and asks for its first 40 lines
           back as the edit's old text
  rewrite  a 150-line file rewritten whole with two changes
  chat     a plain question whose answer copies nothing (lookup must not slow it down)
Each stream asks about its own file. Runs alternate off / on so that a loaded machine's
drift hits both alike; the median of the repeats is reported. Decode tokens/s at 4
streams is the sum of the streams' own rates (they decode together). By default the
engine runs as served by default; --deterministic makes every reply comparable bit for
bit (tokens and logprobs) with plain decoding. --draft measures --draft-model on the same
workloads instead (a request's num_draft_tokens k against 0 in one engine): the model as
its own draft (every greedy token kept: the ceiling, at the cost of k draft forwards of
the full model) or its first --layers layers (untrained); several requests decoding
together take plain steps with a draft.

    python benchmarks/studies/prompt_lookup.py [--k 8] [--max-tokens 192] [--repeats 2]
        [--streams 1 4] [--no-peers] [--deterministic] [--draft self|layer-skip]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from benchmarks.client import Request, send
from benchmarks.names import PEER, VLLM
from benchmarks.server_process import ServerSpec
from benchmarks.servers import start_all, unavailable
from benchmarks.studies.speculative import reply  # one request's tokens, logprobs, usage
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.default import ensure_default_model
from mlx_prefix.models.layer_skip import make_layer_skip_draft
from mlx_prefix.models.load import LoadedModel, load_model
from mlx_prefix.records import PromptInput, SamplingParams
from mlx_prefix.server.protocol.messages import conversation_from_dicts


def source(lines: int, stream: int) -> list[str]:
    """A plain Python file of `lines` lines, its names and numbers the stream's own."""
    out = []
    for i in range(lines // 3 + 1):
        name = f"field_{stream}_{i}"
        out += [f"def {name}(record):", f"    return record.get('{name}', {i * 7 + stream})", ""]
    return out[:lines]


def prompts(stream: int) -> dict[str, str]:
    edit = "\n".join(source(60, stream))
    rewrite = source(150, stream)
    return {
        "edit": "Here is config.py:\n\n" + edit + "\n\nCall the edit tool to replace its first "
        "40 lines: reply with only the edit's old_string, those 40 lines repeated exactly, "
        "line for line.",
        "rewrite": "Rewrite the whole file below with two changes: rename field_"
        f"{stream}_3 to field_{stream}_three, and change the number on line 122 to 999. "
        "Output the complete file, line for line, with no comment.\n\n" + "\n".join(rewrite),
        "chat": "Write a short story about an old lighthouse keeper and a storm at sea.",
    }


@dataclass(frozen=True, slots=True)
class Row:
    server: str  # mlx-prefix, or a peer
    workload: str
    streams: int
    lookup: int  # the requests' prompt_lookup (0: off; a peer: plain)
    completion_tokens: int  # all streams
    decode_tps: float  # the streams' rates summed, median over the repeats
    drafted: int  # per run
    accepted: int
    same_as_plain: bool | None  # tokens (and logprobs) equal to the off run's, every repeat


def _stats(engine: Engine):
    """The drafter's counters: the draft model's where the engine has one, else lookup's."""
    decode = engine.loop.decode
    drafter = decode.speculator if decode.speculator is not None else decode.lookup
    assert drafter is not None, "the engine drafts"
    return drafter.stats


def ours(engine: Engine, name: str, streams: int, k: int, max_tokens: int) -> tuple:
    """One run of `streams` requests decoding together: (summed tok/s, replies, drafted,
    accepted). k drafts by the engine's drafter: its draft model (a request's
    num_draft_tokens) where it has one, else prompt lookup (a request's prompt_lookup)."""
    before = _stats(engine)
    drafted0, accepted0 = before.drafted, before.accepted
    drafts = engine.loop.decode.speculator is not None  # a draft model drafts, else prompt lookup
    out: list = [None] * streams

    def one(i: int) -> None:
        messages = conversation_from_dicts([{"role": "user", "content": prompts(i)[name]}])
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True)
        if drafts:
            sampling = replace(sampling, num_draft_tokens=k)
        else:
            sampling = replace(sampling, prompt_lookup=k)
        out[i] = reply(engine, PromptInput(messages=messages), sampling)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = _stats(engine)
    tps = sum(usage.decode_tokens_per_s for _, _, usage in out)
    replies = [(tokens, logprobs) for tokens, logprobs, _ in out]
    return tps, replies, stats.drafted - drafted0, stats.accepted - accepted0


async def peer(url_of, name: str, streams: int, max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient() as client:
        replies = await asyncio.gather(
            *(
                send(
                    client,
                    url_of,
                    Request(
                        messages=[{"role": "user", "content": prompts(i)[name]}],
                        max_tokens=max_tokens,
                    ),
                )
                for i in range(streams)
            )
        )
    tps = 0.0
    tokens = 0
    for r in replies:
        n = r.completion_tokens or 0
        tokens += n
        if n > 1 and r.ttft_s is not None and r.total_s > r.ttft_s:
            tps += (n - 1) / (r.total_s - r.ttft_s)
    return tps, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--k", type=int, default=8, help="prompt_lookup when on")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--workloads", nargs="+", default=["edit", "rewrite", "chat"])
    p.add_argument("--deterministic", action="store_true")
    p.add_argument(
        "--draft",
        choices=["self", "layer-skip"],
        help="draft with --draft-model instead of prompt lookup: the model itself (every "
        "greedy token kept: the ceiling) or its first --layers layers (untrained)",
    )
    p.add_argument("--layers", type=int, default=16, help="the layer-skip draft's layers")
    p.add_argument("--no-peers", action="store_true", help="mlx-prefix alone")
    p.add_argument("--peers-only", action="store_true", help="the peers alone")
    p.add_argument("--peers", nargs="+", default=[PEER, VLLM], choices=[PEER, VLLM])
    p.add_argument(
        "--vllm-args",
        default="",
        help="vllm-mlx's serve flags beside --continuous-batching (0.6.0 has no n-gram "
        "or text draft-model speculation; '--enable-mtp' serves a model with MTP heads)",
    )
    out = Path(__file__).parents[1] / "out"  # benchmarks/out
    p.add_argument("--out", type=Path, default=out / "prompt_lookup.json")
    args = p.parse_args()
    model_path = ensure_default_model()
    rows: list[Row] = []
    if not args.peers_only:
        rows += measure_ours(model_path, args)
    left_out: dict[str, str] = {}
    if not args.no_peers:
        rows += peers(model_path, args, left_out)
    report(rows, args, left_out)


def _draft(model_path: Path, args, tmp: Path) -> LoadedModel | None:
    if args.draft == "self":
        return load_model(str(model_path))
    if args.draft == "layer-skip":
        return load_model(str(make_layer_skip_draft(model_path, tmp / "draft", args.layers)))
    return None


def measure_ours(model_path: Path, args) -> list[Row]:
    model = load_model(str(model_path))
    config = EngineConfig(deterministic=args.deterministic, prefetch_next_turn=False)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lookup-draft-"))  # the layer-skip draft's files
    draft = _draft(model_path, args, tmp)
    engine = Engine(model, CacheConfig(), config, draft=draft)
    server = "mlx-prefix" if draft is None else f"mlx-prefix --draft-model {args.draft}"
    rows: list[Row] = []
    try:
        for name in args.workloads:
            for streams in args.streams:
                tps: dict[int, list[float]] = {0: [], args.k: []}
                seen: dict[int, list] = {0: [], args.k: []}
                counts = {0: (0, 0), args.k: (0, 0)}
                for _ in range(args.repeats):
                    for k in (0, args.k):
                        rate, replies, drafted, accepted = ours(
                            engine, name, streams, k, args.max_tokens
                        )
                        tps[k].append(rate)
                        seen[k].append(replies)
                        counts[k] = (drafted, accepted)
                        print(name, streams, k, round(rate, 2), counts[k], file=sys.stderr)
                plain = seen[0][0]

                def same(a, b) -> bool:
                    if args.deterministic:
                        return a == b
                    return [t for t, _ in a] == [t for t, _ in b]  # tokens

                for k in (0, args.k):
                    rows.append(
                        Row(
                            server=server,
                            workload=name,
                            streams=streams,
                            lookup=k,
                            completion_tokens=sum(len(t) for t, _ in plain),
                            decode_tps=round(statistics.median(tps[k]), 2),
                            drafted=counts[k][0],
                            accepted=counts[k][1],
                            same_as_plain=all(same(s, plain) for s in seen[k]),
                        )
                    )
    finally:
        engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def report(rows: list[Row], args, left_out: dict[str, str]) -> None:
    base = {
        (r.workload, r.streams): r.decode_tps
        for r in rows
        if r.server.startswith("mlx-prefix") and r.lookup == 0
    }
    print(
        f"{'server':<14} {'workload':<8} {'streams':>7} {'lookup':>6} {'tokens':>6} "
        f"{'tok/s':>7} {'x off':>6} {'accept':>7} same"
    )
    for r in rows:
        accept = f"{r.accepted / r.drafted:.0%}" if r.drafted else "-"
        b = base.get((r.workload, r.streams))
        speedup = r.decode_tps / b if b else 0.0
        print(
            f"{r.server:<14} {r.workload:<8} {r.streams:>7} {r.lookup:>6} "
            f"{r.completion_tokens:>6} {r.decode_tps:>7.2f} {speedup:>6.2f} {accept:>7} "
            f"{r.same_as_plain}"
        )
    for name, why in left_out.items():
        print(f"{name} left out: {why}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "k": args.k,
        "deterministic": args.deterministic,
        "load": os.getloadavg(),
        "left_out": left_out,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


def peers(model_path: Path, args, left_out: dict[str, str]) -> list[Row]:
    """The same requests, plainly decoded by each peer that can start here."""
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench-lookup-"))
    for name in args.peers:
        if (why := unavailable(name)) is not None:
            left_out[name] = why
            continue
        extra = tuple(args.vllm_args.split()) if name == VLLM else ()
        label = " ".join((name, *extra))
        try:
            spec = ServerSpec(name, model_path, extra_args=extra, label=name)
            (server,) = start_all([spec], log_dir)
        except Exception as e:  # a peer that cannot start here is left out, said so
            left_out[name] = repr(e)
            continue
        try:
            for workload in args.workloads:
                for streams in args.streams:
                    runs = [
                        asyncio.run(peer(server, workload, streams, args.max_tokens))
                        for _ in range(args.repeats)
                    ]
                    print(name, workload, streams, runs, file=sys.stderr)
                    rows.append(
                        Row(
                            server=label,
                            workload=workload,
                            streams=streams,
                            lookup=0,
                            completion_tokens=runs[0][1],
                            decode_tps=round(statistics.median(r for r, _ in runs), 2),
                            drafted=0,
                            accepted=0,
                            same_as_plain=None,
                        )
                    )
        finally:
            server.stop()
    return rows


if __name__ == "__main__":
    main()
