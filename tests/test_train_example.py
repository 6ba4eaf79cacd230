"""``examples/train_mnist_like.py`` trains from a fresh interpreter and its loss goes down."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"\s*(\d+)\s+(\d+\.\d+)")


def test_training_example_loss_goes_down():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_mnist_like.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    rows = [m.groups() for line in result.stdout.splitlines() if (m := ROW.fullmatch(line))]
    assert len(rows) >= 2, f"no (step, loss) table:\n{output}"
    steps = [int(step) for step, _ in rows]
    losses = [float(loss) for _, loss in rows]
    assert steps == sorted(steps) and steps[0] == 0, output
    assert losses[-1] < 0.5 * losses[0], output
    assert "PASSED" in result.stdout, output
    accuracy = re.search(r"train accuracy .*: (\d+\.\d)%", result.stdout)
    assert accuracy is not None and float(accuracy.group(1)) > 50, output
