"""``benchmarks/bench_cpu.py --quick`` and ``bench_cold_start.py --quick``: the CPU
benchmarks run end to end on tiny shapes, so that they cannot rot between real runs: every
case and pass (stage), the accuracy check, the Markdown, the JSON and the plot; and they
refuse to write their dry numbers into benchmarks/results."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_cpu.py"
PASSES = {"backward", "forward_training", "forward_inference"}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=REPO
    )


def test_quick_run_writes_every_table(tmp_path):
    result = run("--quick", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (md,) = tmp_path.glob("cpu-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert data["meta"]["quick"] and "QUICK DRY RUN" in md.read_text()
    rows = data["rows"]
    assert {r["pass_"] for r in rows} == PASSES
    assert {r["dtype"] for r in rows} == {"f16", "bf16", "f32", "f64"}
    for row in rows:
        assert set(row["impls"]) >= {"cudnn_bn", "torch", "numpy"}
        assert row["impls"]["cudnn_bn"]["within_tolerance"], row
        assert row["ratio_vs_torch"]["torch"] == 1.0
    assert any("cudnn_bn_compute" in r["impls"] for r in rows)  # the per-call cases
    assert md.with_suffix(".png").exists() or "matplotlib" in result.stderr


def test_quick_run_refuses_the_results_folder():
    result = run("--quick")
    assert result.returncode != 0 and "--quick writes no results" in result.stderr


COLD_START = REPO / "benchmarks" / "bench_cold_start.py"


def test_cold_start_quick_run_writes_its_table(tmp_path):
    """The cold-start benchmark's children (cudnn_bn cold and warm, torch) all run, every
    stage is reported, and the report says it is a dry run."""
    result = subprocess.run(
        [sys.executable, str(COLD_START), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (md,) = tmp_path.glob("cold-start-*.md")
    assert "QUICK DRY RUN" in md.read_text()
    data = json.loads(md.with_suffix(".json").read_text())
    stages = {"import", "readme_block", "f16 backward", "small calls, 4 dtypes", "cpu"}
    for kind in ("cold", "warm", "torch"):
        assert stages <= set(data["runs"][kind][0]), data["runs"][kind][0]


def test_cold_start_quick_run_refuses_the_results_folder():
    result = subprocess.run(
        [sys.executable, str(COLD_START), "--quick"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode != 0 and "--quick writes no results" in result.stderr
