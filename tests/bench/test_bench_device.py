"""Issue 47's device benchmark, without a device: its models' shapes, and its table from a
made-up run (judged on a GPU run only). The script itself ran on this CPU with `--small`
(benchmarks/RESULTS.md, its CPU smoke section)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.device import bench as bench_device
from benchmarks.device import shapes, table


def test_the_shapes_are_the_real_models_and_quantize_in_groups():
    full = shapes.shapes(small=False)
    hybrid = full["hybrid"].config["text_config"]
    assert (hybrid["hidden_size"], hybrid["num_hidden_layers"]) == (2560, 32)  # Qwen3.5-4B
    dense = full["dense"].config
    assert (dense["hidden_size"], dense["num_hidden_layers"]) == (4096, 36)  # Qwen3-8B
    assert {s.dtype for s in full.values()} == {"bfloat16"}
    for shape in (*full.values(), *shapes.shapes(small=True).values()):
        cfg = shape.config.get("text_config", shape.config)
        for key in ("hidden_size", "intermediate_size"):
            assert cfg[key] % shapes.GROUP == 0, (shape.key, key)
    assert shapes.TOKENIZER.joinpath("tokenizer_config.json").is_file()
    assert bench_device.DEVICE.prefill_tokens == 16384 and bench_device.DEVICE.streams == (1, 8, 32)


def _run(backend: str) -> dict:
    def side(tps: list[float], agent: tuple[float, float], rps: float) -> dict:
        decode = [{"streams": n, "tps": t} for n, t in zip((1, 8, 32), tps, strict=True)]
        warm, cold = agent
        extra = {
            "shared_rps_4": rps,
            "unique_rps_4": rps / 2,
            "warm_burst_wall_s": 1.0,
            "itl": {"burst": {"p99_ms": 20.0}},
            "decode_tps": tps[0],
        }
        return {
            "decode": decode,
            "agent": {
                "prompt_tokens": 8000,
                "warm_ttft_s": warm,
                "cold_ttft_s": cold,
                "warm_over_cold": warm / cold,
            },  # fmt: skip
            "throughput": {"extra": extra},
        }

    model = {
        "key": "dense",
        "description": "Qwen3-8B-shaped dense (qwen3), 4-bit",
        "weights_bytes": 4 * 2**30,
        "prefill": {
            "ours": {"prompt_tokens": 16390, "tps": 9000.0},
            "mlx_lm.generate": {"prompt_tokens": 16390, "tps": 10000.0},
        },  # fmt: skip
        "servers": {
            "mlx-prefix": side([100.0, 600.0, 1500.0], (0.05, 1.0), 3.0),
            "mlx_lm.server": side([95.0, 400.0, 1000.0], (0.5, 1.0), 2.0),
        },
        "mlx_lm.generate decode": {"extra": {"decode_tps": 110.0, "decode_tokens": 128}},
        "notes": [],
    }
    return {"backend": backend, "label": "NVIDIA H100 (cuda)", "models": [model],
            "machine": {"cpu": "x", "cores": 16, "ram_gib": 128}, "timestamp": "t"}  # fmt: skip


def test_the_table_judges_the_goals_on_a_gpu_run_only():
    md = table.markdown(_run("cuda"))
    lines = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()}
    assert "0.90x | >= 0.95x missed" in lines["prefill, 16390-token prompt, cold"]
    assert ">= 1.2x met" in lines["decode, 8 streams"] and "1.50x" in lines["decode, 8 streams"]
    assert ">= 1x missed" in lines["decode, 1 stream, 128 tokens (throughput workload's)"]
    assert "0.05x | <= 0.1x met" in lines["agent: warm TTFT / cold TTFT"]
    assert "1.50x | >= 1.3x met" in lines["throughput: requests/s, 4 clients, shared prompt"]
    cpu = table.markdown(_run("cpu"))
    assert "met" not in cpu and "missed" not in cpu and "not judged" in cpu


def test_kept_tables_make_a_results_section(tmp_path: Path):
    assert table.kept_section(tmp_path) == ""
    (tmp_path / table.KEPT).mkdir(parents=True)
    (tmp_path / table.KEPT / "cpu-smoke.md").write_text("### CPU smoke run: x\n")
    section = table.kept_section(tmp_path)
    assert "## Device benchmark" in section and "### CPU smoke run: x" in section
    assert bench_device._slug("NVIDIA H100 80GB HBM3 (cuda)") == "nvidia-h100-80gb-hbm3-cuda"
