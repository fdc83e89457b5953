"""Issue 47's device benchmark: mlx-prefix beside mlx_lm.server and mlx_lm.generate, from
the same wheels in the same run, on random-weight 4-bit models of real shapes built in
the run (benchmarks/device/shapes.py): a Qwen3.5-4B-shaped hybrid and a Qwen3-8B-shaped
dense model. Per model: cold prefill of a 16K-token prompt (`mlx-prefix generate` against
`mlx_lm.generate`), decode at 1, 8 and 32 streams, an agent's warm turn against its cold
one, and issue 33's throughput workload (benchmarks/device/measures.py says how each is
measured). The servers run one at a time, each alone on the device.

    python -m benchmarks.device [--small] [--models hybrid,dense] [--out DIR]

Writes <out>/device-<stamp>.json and .md (the table). `--small`: the same architectures,
narrow and shallow, at CPU sizes: a smoke run of the whole script on a machine without a
GPU. On the lent GPU machine, benchmarks/device/run.sh runs it from prepared wheels.
Stages are skipped (and say so) once `--budget-s` is spent, so a run always ends with
what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..harness import run_async
from ..models import BenchModel, Tokens
from ..names import OURS, PEER
from ..profiles import PROFILES, Sizes
from ..report.machine import machine_info
from ..server_process import Server, ServerSpec
from . import measures, shapes, table


@dataclass(frozen=True)
class Plan:
    prefill_tokens: int
    streams: tuple[int, ...]
    decode_tokens: int
    agent_system_tokens: int
    agent_reply_tokens: int
    agent_pause_s: float
    throughput: Sizes  # issue 33's workload sizes


_QUICK = PROFILES["quick"].plans[0].sizes
DEVICE = Plan(
    16384,
    (1, 8, 32),
    128,
    8000,
    64,
    2.0,
    replace(
        _QUICK,
        throughput_requests_per_client=2,
        throughput_max_tokens=32,
        throughput_decode_tokens=128,
    ),
)
SMALL = Plan(1024, (1, 8, 32), 8, 600, 16, 2.0, PROFILES["smoke"].plans[0].sizes)


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> bool:
        return self.spent() < self.budget_s


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return None


def _label(doc: dict[str, Any], small: bool) -> str:
    """Which machine a table is of: the GPU's name, or the CPU's for a smoke run."""
    if small or doc.get("backend") not in ("cuda", "metal"):
        return f"CPU smoke run: {doc['machine'].get('cpu', '?')}"
    line = doc.get("device_line", "")
    name = line.split("(", 1)[1].rstrip(")") if "(" in line else doc.get("backend", "gpu")
    return f"{name} ({doc.get('backend')})"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def log(msg: str) -> None:
    print(f"[device {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _probe() -> dict[str, Any]:
    """Device, backend and versions, read in a child (this process never holds the GPU)."""
    code = (
        "import json, mlx.core as mx, mlx_lm\n"
        "from mlx_prefix import platform as p\n"
        "print(json.dumps({'backend': p.backend_name(), 'device_line': p.startup_line(),"
        " 'mlx': mx.__version__, 'mlx_lm': mlx_lm.__version__}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"backend": "?", "device_line": f"probe failed: {out.stderr[-300:]}"}


def _build(key: str, small: bool, dest: Path) -> None:
    """In a child: building a model holds all its memory, which the servers need next."""
    cmd = [sys.executable, "-m", "benchmarks.device", "--build", key, "--work", str(dest)]
    subprocess.run([*cmd, *(["--small"] if small else [])], check=True, timeout=1800)


def _servers_side(
    name: str, model: BenchModel, tokens: Tokens, plan: Plan, out: Path, clock: Clock
) -> dict[str, Any]:
    """Every server measure on one server, started alone, then stopped."""
    rec: dict[str, Any] = {"notes": []}
    spec = ServerSpec(name, model.path, (), "ours" if name == OURS else "peer")
    t = time.perf_counter()
    server = Server(spec, out / "logs").start()
    rec["start_s"] = time.perf_counter() - t
    bias = measures.no_eos(tokens)
    ctx = measures.DeviceContext(plan.throughput, model, tokens, out, {name: server}, log=log)
    try:

        async def run(client) -> None:
            rec["decode"] = []
            for n in plan.streams:
                if not clock.left():
                    rec["notes"].append(f"decode at {n} streams: out of time")
                    continue
                level = await measures.decode(client, server, n, plan.decode_tokens, bias)
                rec["decode"].append(level)
                log(f"  {name}: decode x{n}: {level.get('tps') or 0:.1f} tok/s")
            if clock.left():
                rec["agent"] = await measures.agent(
                    client,
                    server,
                    tokens,
                    plan.agent_system_tokens,
                    plan.agent_reply_tokens,
                    plan.agent_pause_s,
                    bias,
                )
                log(f"  {name}: agent {rec['agent']}")
            if clock.left():
                rec["throughput"] = await measures.throughput_on(ctx, server, client)
                log(f"  {name}: throughput done ({rec['throughput']['wall_s']:.1f}s)")

        run_async(run)
    finally:
        ctx.close()
        server.stop()
    return rec


def run_model(key: str, small: bool, plan: Plan, work: Path, out: Path, clock: Clock) -> dict:
    shape = shapes.shapes(small)[key]
    rec: dict[str, Any] = {"key": key, "description": shape.description, "notes": []}
    dest = work / f"{key}{'-small' if small else ''}"
    t = time.perf_counter()
    _build(key, small, dest)
    rec["build_s"], rec["weights_bytes"] = time.perf_counter() - t, shapes.nbytes(dest)
    log(f"{key}: built in {rec['build_s']:.0f}s, {rec['weights_bytes'] / 2**30:.2f} GiB")
    model = BenchModel(key, dest, shape.description)
    tokens = Tokens(dest)
    if clock.left():
        text = measures.prefill_text(tokens, plan.prefill_tokens)
        rec["prefill"] = {
            "ours": measures.prefill_ours(dest, text),
            "mlx_lm.generate": measures.prefill_mlx_lm(dest, text),
        }
        log(f"{key}: prefill {rec['prefill']}")
    rec["servers"] = {}
    for name in (OURS, PEER):
        if not clock.left():
            rec["notes"].append(f"{name}: out of time")
            continue
        try:
            rec["servers"][name] = _servers_side(name, model, tokens, plan, out, clock)
        except Exception as e:  # one server's failure leaves the other's rows
            log(f"{key}: {name} failed: {e!r}")
            rec["notes"].append(f"{name} failed: {e!r}")
    if clock.left():
        ctx = measures.DeviceContext(plan.throughput, model, tokens, out, {}, log=log)
        rec["mlx_lm.generate decode"] = measures.generate_decode(ctx)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__)
    p.add_argument("--small", action="store_true", help="narrow models, CPU sizes (a smoke run)")
    p.add_argument("--models", default="hybrid,dense", help="comma-separated: hybrid, dense")
    p.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "out" / "device")
    p.add_argument("--work", type=Path, help="where the models are built (reused if there)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stages start until then")
    p.add_argument(
        "--keep",
        action="store_true",
        help="also write the table to benchmarks/results/device/ (RESULTS.md shows it)",
    )
    p.add_argument("--build", help=argparse.SUPPRESS)  # the child that builds one model
    args = p.parse_args(argv)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "mlx-prefix-device-models"
    if args.build:
        shapes.build(shapes.shapes(args.small)[args.build], work)
        return 0
    keys = [k for k in args.models.split(",") if k]
    unknown = set(keys) - {"hybrid", "dense"}
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; choose from hybrid, dense")
    plan, clock = (SMALL if args.small else DEVICE), Clock(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    doc: dict[str, Any] = {"profile": "small (CPU smoke)" if args.small else "device"}
    doc |= _probe()
    doc |= {"timestamp": stamp, "machine": machine_info(), "load": [_load()]}
    doc |= {"plan": asdict(plan), "models": []}
    doc["label"] = _label(doc, args.small)
    log(doc["device_line"])
    for key in keys:
        try:
            doc["models"].append(run_model(key, args.small, plan, work, args.out, clock))
        except Exception as e:
            log(f"{key} failed: {e!r}")
            doc["models"].append({"key": key, "notes": [f"failed: {e!r}"]})
    doc["elapsed_s"] = clock.spent()
    doc["load"].append(_load())
    json_path = args.out / f"device-{stamp}.json"
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md = table.markdown(doc)
    (args.out / f"device-{stamp}.md").write_text(md)
    if args.keep:
        kept = Path(__file__).parent.parent / table.KEPT / f"{_slug(doc['label'])}.md"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(md)
    print(md)
    log(f"wrote {json_path} ({doc['elapsed_s']:.0f}s)")
    return 0
