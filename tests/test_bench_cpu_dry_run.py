"""``benchmarks/bench_cpu.py --quick``: the CPU benchmark runs end to end on tiny shapes, so
that it cannot rot between real runs: every case and pass, the accuracy check, the Markdown,
the JSON and the plot; and it refuses to write its dry numbers into benchmarks/results."""

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
