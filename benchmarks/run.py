"""`python -m benchmarks`: mlx-prefix, mlx_lm.server and vllm-mlx side by side, same model,
same machine, same run (vllm-mlx where `make peers` installed it). Writes
<out>/<timestamp>.json, <report-dir>/RESULTS.md and PNG plots in <report-dir>/results/.

Run it under `python -m mlx_prefix.blas_exec` (as `make bench` does) so the in-process
restore benchmark gets the fast BLAS too; the servers always get it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from . import goals, profiles, report, screenshot
from .harness import Context, ServerResult, WorkloadResult, run_async
from .models import BenchModel, Tokens, resolve
from .profiles import MODEL_WORKLOADS, ONCE_WORKLOADS, SHARDED_WORKLOADS, Sizes
from .report import kept, machine
from .servers import (
    OURS,
    PEER,
    PEERS,
    SERVERS,
    VLLM,
    ServerFailed,
    ServerSpec,
    start_all,
    unavailable,
)
from .workloads import WORKLOADS
from .workloads.restart import Skip

HERE = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--profile", choices=sorted(profiles.PROFILES), default="quick")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="model folder, or 'dense' / 'hybrid' (repeatable; default: the "
        "profile's models: dense, then hybrid). A folder takes the sizes and workloads of "
        "the profile's plan at its position",
    )
    p.add_argument("--workloads", help="comma-separated subset of: " + ",".join(WORKLOADS))
    p.add_argument("--out", type=Path, default=HERE / "out", help="raw JSON and server logs")
    p.add_argument(
        "--report-dir",
        type=Path,
        default=HERE,
        help="where RESULTS.md and results/*.png go (default: benchmarks/)",
    )
    p.add_argument("--max-tokens", type=int, help="override the profile's reply length")
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated peers to run beside mlx-prefix (default: {','.join(PEERS)}; "
        "vllm-mlx only where `make peers` installed it)",
    )
    p.add_argument(
        "--dashboard-png",
        action="store_true",
        help="after the first chat workload, save a screenshot of mlx-prefix's dashboard "
        "as <report-dir>/results/dashboard.png (needs playwright and Chrome or Chromium)",
    )
    p.add_argument(
        "--report",
        type=Path,
        nargs="*",
        metavar="JSON",
        help="only re-render RESULTS.md and the plots: from these runs' JSON, or without "
        "one from the runs kept in <report-dir>/results/runs/",
    )
    return p.parse_args(argv)


def run_model(ctx: Context, names: list[str], png: Path | None = None) -> list[WorkloadResult]:
    """Run the workloads on the shared servers; `png`: where to save a screenshot of our
    dashboard right after the chat workload (None: no screenshot)."""
    results = []
    servers = list(ctx.servers.values())
    for i, name in enumerate(names):
        mod = WORKLOADS[name]
        log(f"{ctx.model.key}: {name} ({mod.describe(ctx.sizes)})")
        wr = WorkloadResult(name, mod.TITLE, ctx.model.key, {})
        t = time.perf_counter()
        try:
            if hasattr(mod, "run_standalone"):
                wr.servers = mod.run_standalone(ctx)
            else:
                # Alternate which server goes first, so neither always runs on a cooler box.
                for server in servers if i % 2 == 0 else servers[::-1]:
                    try:
                        wr.servers[server.name] = run_async(
                            lambda c, s=server, m=mod: m.run(ctx, s, c)
                        )
                    except Exception as e:
                        log(f"  {server.name} failed: {e}")
                        failed = ServerResult(server.name, notes=[f"error: {e}"])
                        wr.servers[server.name] = failed
                        traceback.print_exc()
        except Skip as e:
            wr.skipped = str(e)
            log(f"  skipped: {e}")
        except Exception as e:
            traceback.print_exc()
            wr.servers = {s: ServerResult(s, notes=[f"error: {e}"]) for s in ctx.servers}
        wr.elapsed_s = time.perf_counter() - t
        for name_, res in sorted(wr.servers.items()):
            log(
                f"  {name_}: wall {res.wall_s:.1f}s reuse {res.reuse()} "
                f"checks {sum(c.match for c in res.checks)}/{len(res.checks)}"
            )
        log(f"  {name} took {wr.elapsed_s:.1f}s (server starts and cold checks included)")
        results.append(wr)
        if name == "chat" and png is not None:
            screenshot.dashboard_png(ctx.servers[OURS].url, png, log)
    return results


def run_once(name: str, sizes: Sizes, model: BenchModel) -> WorkloadResult:
    mod = WORKLOADS[name]
    log(f"{name} (in-process; {mod.describe(sizes)})")
    label = "synthetic KV" if name == "restore" else model.key
    wr = WorkloadResult(name, mod.TITLE, label, {})
    t = time.perf_counter()
    try:
        wr.servers = mod.run_once(sizes, model)
    except Exception as e:
        traceback.print_exc()
        wr.servers = {OURS: ServerResult(OURS, notes=[f"error: {e}"])}
    wr.elapsed_s = time.perf_counter() - t
    log(f"  {name} took {wr.elapsed_s:.1f}s")
    return wr


def describe(plan_sizes: Sizes, names: list[str]) -> dict[str, str]:
    return {w: WORKLOADS[w].describe(plan_sizes) for w in names}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        docs = kept.load(args.report) if args.report else kept.kept(args.report_dir)
        if not docs:
            raise SystemExit(f"no runs in {kept.runs_dir(args.report_dir)}")
        log(f"wrote {render(docs, args.report_dir)}")
        return 0
    prof = profiles.get(args.profile, max_tokens=args.max_tokens)
    selected = args.workloads.split(",") if args.workloads else None
    unknown = [w for w in selected or () if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    peers = [p for p in args.peers.split(",") if p]
    if not set(peers) <= set(PEERS):
        raise SystemExit(f"unknown peers {sorted(set(peers) - set(PEERS))}; choose from {PEERS}")
    model_keys = args.model or list(prof.models)
    left_out: dict[str, str] = {}  # "server (model)" -> why it did not take part
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_before = _load()
    results: list[WorkloadResult] = []
    models: dict[str, dict] = {}
    plans: list[dict] = []
    once: tuple[list[str], Sizes, BenchModel] | None = None

    for i, key in enumerate(model_keys):
        plan = prof.plan_for(key, i)
        wanted = selected if selected is not None else plan.workloads
        names = [w for w in MODEL_WORKLOADS if w in wanted]
        once_names = [w for w in ONCE_WORKLOADS if w in wanted] if i == 0 else []
        if not names and not once_names:
            continue
        model = resolve(key)
        if model.ranks > 1:  # the other workloads would start their own 1-rank servers
            dropped = [w for w in names if w not in SHARDED_WORKLOADS]
            names = [w for w in names if w in SHARDED_WORKLOADS]
            if dropped:
                log(f"{model.key}: {', '.join(dropped)} not run on {model.ranks} ranks")
        plans.append(
            {
                "model": model.key,
                "plan": plan.model,
                "sizes": asdict(plan.sizes),
                "described": describe(plan.sizes, names + once_names),
            }
        )
        if once_names:
            once = (once_names, plan.sizes, model)
        if not names:
            continue
        log(f"model {model.key}: {model.description} ({model.path})")
        specs = [ServerSpec(OURS, model.path, (), "ours", model.ranks)]
        for name, label in ((PEER, "peer"), (VLLM, "vllm-mlx")):
            why = None if name in peers else "not asked for (--peers)"
            why = why or unavailable(name, model.ranks)
            if why is None:
                specs.append(ServerSpec(name, model.path, (), label, model.ranks))
            else:
                left_out[f"{name} ({model.key})"] = why
                log(f"{model.key}: {name} left out: {why}")
        info = {"path": str(model.path), "description": model.description, "ranks": model.ranks}
        models[model.key] = info
        t = time.perf_counter()
        try:
            servers = start_all(specs, args.out / "logs", optional=(VLLM,), log=log)
        except ServerFailed as e:
            if model.ranks == 1:
                raise
            log(f"  {model.key}: skipped: {e}")
            results += [WorkloadResult(n, WORKLOADS[n].TITLE, model.key, {}, str(e)) for n in names]
            continue
        up = time.perf_counter() - t
        log(f"servers up in {up:.1f}s")
        info["servers_up_s"] = up
        info["blas"] = {s.name: s.blas() for s in servers}  # what each process mapped
        info["servers"] = [s.name for s in servers]
        for spec in specs:
            if spec.name not in info["servers"]:
                why = f"did not start (see {args.out / 'logs'})"
                left_out[f"{spec.name} ({model.key})"] = why
        ctx = Context(
            plan.sizes, model, Tokens(model.path), args.out, {s.name: s for s in servers}, log=log
        )
        first_chat = "chat" in names and not any(r.workload == "chat" for r in results)
        png = args.report_dir / "results" / "dashboard.png" if args.dashboard_png else None
        try:
            results += run_model(ctx, names, png if first_chat else None)
        finally:
            ctx.close()
            for s in servers:
                s.stop()

    if once is not None:
        once_names, sizes, model = once
        results += [run_once(name, sizes, model) for name in once_names]

    doc = {
        "profile": prof.name,
        "timestamp": stamp,
        "elapsed_s": time.perf_counter() - started,
        # What else ran: the 1-minute load average before and after (None: not known).
        "machine": machine.machine_info() | {"load": [load_before, _load()]},
        "versions": machine.versions(),
        "models": models,
        "servers": [s for s in SERVERS if any(s in m.get("servers", ()) for m in models.values())],
        "left_out": left_out,
        "settings": {"temperature": 0.0},
        "plans": plans,
        "other_profiles": {
            name: [
                {
                    "model": p.model,
                    "sizes": asdict(p.sizes),
                    "described": describe(p.sizes, list(p.workloads)),
                }
                for p in other.plans
            ]
            for name, other in profiles.PROFILES.items()
            if name in ("quick", "full") and name != prof.name
        },
        "asked": {w: WORKLOADS[w].ASKED for w in WORKLOADS},
        "workloads": [r.to_json() for r in results],
    }
    doc["goals"] = [asdict(g) for g in goals.evaluate(doc)]
    json_path = args.out / f"{stamp}.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    kept.keep(doc, args.report_dir)
    md_path = render(kept.kept(args.report_dir), args.report_dir)
    log(f"wrote {json_path}, {md_path} ({doc['elapsed_s']:.0f}s)")
    return 0


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return None


def render(docs: list[dict], report_dir: Path) -> Path:
    """RESULTS.md and the plots from these runs: per workload and model, the newest."""
    doc = kept.merge(docs)
    doc["goals"] = [asdict(g) for g in goals.evaluate(doc)]
    return report.write(doc, report_dir)
