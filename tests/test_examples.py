"""The scripts in ``examples/`` run from a fresh interpreter and report success."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_infiniop_style_script_passes_every_case_on_cpu():
    pytest.importorskip("torch")
    result = run_example("infiniop_batch_norm_backward.py", "--cpu")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = result.stdout.strip().splitlines()
    assert lines, output
    summary = re.fullmatch(r"(\d+) passed, (\d+) failed", lines[-1])
    assert summary is not None, f"last line is not 'N passed, N failed':\n{output}"
    passed, failed = map(int, summary.groups())
    assert passed > 0 and failed == 0, output
    assert sum(" PASS " in line for line in lines) == passed, output


def test_batch_norm_backward_example_passes():
    result = run_example("batch_norm_backward.py")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "PASSED" in output, output
