"""``CUDNN_BN_LOG_API_ARGS=1`` prints every cuDNN call with its arguments (and only then)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
from cudnn_bn._cudnn.enums import CudnnDataType
from cudnn_bn._cudnn.tensor import TensorDescriptor
TensorDescriptor.nd(CudnnDataType.FLOAT, (2, 3, 4, 5), (60, 20, 5, 1)).close()
"""


@pytest.mark.parametrize("value", ["1", "0", None])
def test_calls_are_logged_only_when_asked(value):
    env = {k: v for k, v in os.environ.items() if k != "CUDNN_BN_LOG_API_ARGS"}
    env["PYTHONPATH"] = str(ROOT)
    if value is not None:
        env["CUDNN_BN_LOG_API_ARGS"] = value
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    logged = [line for line in result.stderr.splitlines() if line.startswith("cudnn_bn: ")]
    if value == "1":
        names = [line.split("(")[0].removeprefix("cudnn_bn: ") for line in logged]
        assert names == [
            "cudnnCreateTensorDescriptor",
            "cudnnSetTensorNdDescriptor",
            "cudnnDestroyTensorDescriptor",
        ]
        # The arguments, arrays by their values: dtype, rank, dims, strides.
        assert "CudnnDataType.FLOAT: 0>, 4, [2, 3, 4, 5], [60, 20, 5, 1])" in logged[1]
    else:
        assert logged == []
