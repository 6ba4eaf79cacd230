"""NumPy arrays are described from their attributes exactly as from their array interface."""

import ml_dtypes
import numpy as np
import pytest

from cudnn_bn.arrays import _from_interface, operand
from cudnn_bn.enums import Device

BASE = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)


def _read_only(array: np.ndarray) -> np.ndarray:
    array = array.copy()
    array.flags.writeable = False
    return array


ARRAYS = {
    "contiguous": BASE,
    "size-1 axis with a stray stride": np.lib.stride_tricks.as_strided(
        BASE, (4, 1, 5), (120, 400, 4)
    ),
    "transposed": BASE.transpose(0, 2, 1),
    "reversed": BASE[::-1],
    "sliced": BASE[:, ::2, 1:],
    "broadcast": np.broadcast_to(BASE[0, 0], (3, 5)),
    "read-only": _read_only(BASE),
    "from bytes": np.frombuffer(BASE.tobytes(), np.float32).reshape(BASE.shape),
    "empty": BASE[:0],
    "0-d": np.float64(2.0).reshape(()),
    "float16": BASE.astype(np.float16),
    "bfloat16": BASE.astype(ml_dtypes.bfloat16),
}


@pytest.mark.parametrize("array", ARRAYS.values(), ids=ARRAYS.keys())
def test_ndarray_operand_is_its_interfaces(array):
    expected = _from_interface("x", array.__array_interface__, Device.CPU, 0, array.dtype)
    assert operand("x", array) == expected
