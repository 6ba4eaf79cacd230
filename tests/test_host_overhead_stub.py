"""The stub host-overhead benchmark runs and reports one figure per operator."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the stub libcudnn")
def test_reports_a_time_per_compute(tmp_path):
    out = tmp_path / "overhead.md"
    command = [
        sys.executable,
        "benchmarks/host_overhead_stub.py",
        "--calls",
        "50",
        "--out",
        str(out),
    ]
    result = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"\| `(BatchNorm\w+)\.compute` \| ([\d.]+) \|", out.read_text())
    assert [name for name, _ in rows] == [
        "BatchNormBackward",
        "BatchNormForwardTraining",
        "BatchNormForwardInference",
    ]
    assert all(float(us) > 0 for _, us in rows)
