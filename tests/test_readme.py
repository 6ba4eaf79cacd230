"""Every Python block of README.md runs as written.

A block whose first line is ``# needs a CUDA GPU`` is compiled here and run by the ``gpu``
tests; every other block runs here, each in a fresh interpreter in an empty directory, so a
block that leans on another's names or on the working tree fails.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
GPU_MARK = "# needs a CUDA GPU"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def _blocks(gpu: bool) -> list:
    return [
        pytest.param(block, id=f"block{i}")
        for i, block in enumerate(BLOCKS)
        if block.startswith(GPU_MARK) == gpu
    ]


def _run(block: str, cwd: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README block failed:\n{block}\n{done.stdout}\n{done.stderr}"


def test_readme_has_cpu_and_gpu_blocks():
    assert _blocks(gpu=False) and _blocks(gpu=True)


@pytest.mark.parametrize("block", _blocks(gpu=False))
def test_cpu_block_runs(block, tmp_path):
    _run(block, tmp_path)


@pytest.mark.parametrize("block", _blocks(gpu=True))
def test_gpu_block_compiles(block):
    compile(block, "README.md", "exec")


@pytest.mark.gpu
@pytest.mark.parametrize("block", _blocks(gpu=True))
def test_gpu_block_runs(block, tmp_path):
    _run(block, tmp_path)
