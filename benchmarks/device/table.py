"""The device benchmark's markdown: one table per model, each row a measure with both
sides, their ratio and issue 47's goal for the GPU (judged only on a GPU run: a CPU
smoke run shows the figures and leaves the goals unjudged)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (what, ours / other at least (True) or at most (False), the limit): issue 47's goals.
PREFILL_GOAL = 0.95  # x mlx_lm.generate
DECODE_GOALS = {1: 1.0, 8: 1.2, 32: 1.2}  # x mlx_lm.server, by streams
GENERATE_DECODE_GOAL = 1.0  # one stream, x mlx_lm.generate
AGENT_GOAL = 0.1  # warm turn TTFT at most this x cold
RPS_GOALS = {"shared": 1.3, "unique": 1.0}  # issue 33, x the peer
BURST_WALL, ITL_P99 = 0.8, 1.0  # issue 33, at most


@dataclass(frozen=True)
class Row:
    what: str
    ours: float | None
    other: float | None
    other_name: str
    unit: str
    limit: float | None  # the goal on the ratio ours / other
    at_least: bool = True

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.other:
            return None
        return self.ours / self.other

    def verdict(self, judged: bool) -> str:
        if self.limit is None:
            return ""
        goal = f"{'>=' if self.at_least else '<='} {self.limit:g}x"
        if not judged or self.ratio is None:
            return goal
        met = self.ratio >= self.limit if self.at_least else self.ratio <= self.limit
        return f"{goal} {'met' if met else 'missed'}"


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "x":
        return f"{value:.3f}x"
    digits = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:,.{digits}f} {unit}"


def rows(model: dict[str, Any]) -> Iterator[Row]:
    """Every measured row of one model's record (what did not run is left out)."""
    pre = model.get("prefill", {})
    ours, gen = pre.get("ours", {}), pre.get("mlx_lm.generate", {})
    n = ours.get("prompt_tokens") or gen.get("prompt_tokens")
    if ours or gen:
        what = f"prefill, {n or '?'}-token prompt, cold"
        yield Row(what, ours.get("tps"), gen.get("tps"), "mlx_lm.generate", "tok/s", PREFILL_GOAL)
    servers = model.get("servers", {})
    mine, peer = servers.get("mlx-prefix", {}), servers.get("mlx_lm.server", {})
    for level in mine.get("decode", []):
        streams = level["streams"]
        theirs = next((d for d in peer.get("decode", []) if d["streams"] == streams), {})
        what = f"decode, {streams} stream{'s' if streams > 1 else ''}"
        limit = DECODE_GOALS.get(streams)
        yield Row(what, level.get("tps"), theirs.get("tps"), "mlx_lm.server", "tok/s", limit)
    ref = model.get("mlx_lm.generate decode", {}).get("extra", {})
    t_ours = mine.get("throughput", {}).get("extra", {})
    if ref.get("decode_tps") or t_ours.get("decode_tps"):
        what = f"decode, 1 stream, {ref.get('decode_tokens') or '?'} tokens (throughput workload's)"
        yield Row(
            what,
            t_ours.get("decode_tps"),
            ref.get("decode_tps"),
            "mlx_lm.generate",
            "tok/s",
            GENERATE_DECODE_GOAL,
        )
    a_ours, a_peer = mine.get("agent", {}), peer.get("agent", {})
    if a_ours or a_peer:
        n = a_ours.get("prompt_tokens") or a_peer.get("prompt_tokens")
        for side, rec in (("warm", "warm_ttft_s"), ("cold", "cold_ttft_s")):
            what = f"agent's next turn ({n or '?'} tokens), {side} TTFT"
            yield Row(what, a_ours.get(rec), a_peer.get(rec), "mlx_lm.server", "s", None)
        yield Row(
            "agent's next turn, warm / cold TTFT (each server's own)",
            a_ours.get("warm_over_cold"),
            a_peer.get("warm_over_cold"),
            "mlx_lm.server",
            "x",
            None,
        )
    t_peer = peer.get("throughput", {}).get("extra", {})
    for variant, limit in RPS_GOALS.items():
        keys = [k for k in t_ours if k.startswith(f"{variant}_rps_")]
        for key in sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1])):
            clients = key.rsplit("_", 1)[1]
            what = f"throughput: requests/s, {clients} clients, {variant} prompt"
            yield Row(what, t_ours.get(key), t_peer.get(key), "mlx_lm.server", "req/s", limit)
    if "warm_burst_wall_s" in t_ours:
        yield Row(
            "throughput: warm burst wall time",
            t_ours.get("warm_burst_wall_s"),
            t_peer.get("warm_burst_wall_s"),
            "mlx_lm.server",
            "s",
            BURST_WALL,
            at_least=False,
        )
        p99 = [(t.get("itl", {}).get("burst") or {}).get("p99_ms") for t in (t_ours, t_peer)]
        yield Row(
            "throughput: p99 inter-token latency in the burst",
            *p99,
            "mlx_lm.server",
            "ms",
            ITL_P99,
            at_least=False,
        )


def agent_row(model: dict[str, Any]) -> Row | None:
    """The agent goal: our warm turn against our own cold one."""
    a = model.get("servers", {}).get("mlx-prefix", {}).get("agent", {})
    if not a.get("warm_ttft_s"):
        return None
    return Row(
        "agent: warm TTFT / cold TTFT",
        a["warm_ttft_s"],
        a.get("cold_ttft_s"),
        "own cold",
        "s",
        AGENT_GOAL,
        False,
    )


def machine_line(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    load = doc.get("load") or [None, None]
    return (
        f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('ram_gib', '?')} GiB; "
        f"{doc.get('device_line', '?').removeprefix('mlx-prefix: ')}; mlx {doc.get('mlx', '?')}, "
        f"mlx-lm {doc.get('mlx_lm', '?')}; load {load[0]} / {load[1]}; run {doc.get('timestamp')}, "
        f"{(doc.get('elapsed_s') or 0) / 60:.1f} min"
    )


def markdown(doc: dict[str, Any]) -> str:
    judged = doc.get("backend") == "cuda" or doc.get("backend") == "metal"
    lines = [
        f"### {doc.get('label', 'device benchmark')}",
        "",
        f"Machine: {machine_line(doc)}.",
        "",
    ]
    if not judged:
        lines += [
            "A CPU smoke run of the device benchmark (`--small`: the same architectures, 4 "
            "layers of 256, at CPU sizes): it shows the script runs end to end; its figures "
            "say nothing about a GPU, and the goals (the GPU's) are not judged here.",
            "",
        ]
    for model in doc.get("models", []):
        lines += [
            f"**{model['key']}**: {model.get('description', '')}, "
            f"{(model.get('weights_bytes') or 0) / 2**30:.2f} GiB of weights",
            "",
            "| measure | mlx-prefix | beside it | ours / theirs | goal (GPU) |",
            "|---|---|---|---|---|",
        ]
        table = list(rows(model))
        if (agent := agent_row(model)) is not None:
            table.append(agent)
        for r in table:
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
            other = f"{_num(r.other, r.unit)} ({r.other_name})"
            lines.append(
                f"| {r.what} | {_num(r.ours, r.unit)} | {other} | {ratio} | {r.verdict(judged)} |"
            )
        for note in model.get("notes", []):
            lines.append(f"\n- {note}")
        lines.append("")
    return "\n".join(lines) + "\n"


KEPT = "results/device"  # under benchmarks/: one table per device, the newest run's


def kept_section(report_dir: Path) -> str:
    """RESULTS.md's section of the kept device tables (empty when there are none)."""
    tables = sorted((report_dir / KEPT).glob("*.md"))
    if not tables:
        return ""
    head = [
        "",
        "## Device benchmark",
        "",
        "`python -m benchmarks.device` (on a lent GPU: benchmarks/device/run.sh): "
        "random-weight 4-bit models of real shapes, mlx-prefix beside mlx_lm.server and "
        "mlx_lm.generate from the same wheels in the same run, each server alone on the "
        "device. One table per machine, the newest run's (`--keep`).",
        "",
    ]
    return "\n".join(head) + "\n" + "\n".join(t.read_text() for t in tables)
