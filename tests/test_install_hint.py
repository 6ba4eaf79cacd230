"""A GPU array handed to an install without the CUDA extra names the extra to install."""

import subprocess
import sys

CHILD = r"""
import sys
sys.modules["cupy"] = None  # as in `pip install cudnn_bn`, without an extra
import numpy as np
import cudnn_bn


class DeviceArray:
    # A CUDA array of another library: only its interface, which needs CuPy to be located.
    def __init__(self, shape):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "<f4", "data": (1 << 40, False), "version": 3,
            "strides": None, "stream": None,
        }


x, w = DeviceArray((4, 3, 5)), DeviceArray((3,))
try:
    cudnn_bn.batch_norm_backward(x, x, w, None, None)
except cudnn_bn.InfiniError as exc:
    print(exc)
else:
    print("no error")
"""


def test_gpu_array_without_cupy_names_the_extra():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'cudnn_bn[cuda12]'" in done.stdout, done.stdout
    assert "CuPy" in done.stdout, done.stdout
