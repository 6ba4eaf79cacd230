"""NumPy arrays are described from their attributes exactly as from their array interface."""

import ml_dtypes
import numpy as np
import pytest

from cudnn_bn.arrays import NUMPY, operand
from cudnn_bn.arrays.numpy_arrays import from_array_interface

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
    "0-d": np.array(2.0),
    "float16": BASE.astype(np.float16),
    "bfloat16": BASE.astype(ml_dtypes.bfloat16),
}


@pytest.mark.parametrize("array", ARRAYS.values(), ids=ARRAYS.keys())
def test_ndarray_operand_is_its_interfaces(array):
    class Interface:  # the array seen only through its interface (and dtype, for bfloat16)
        __array_interface__ = array.__array_interface__
        dtype = array.dtype

    assert operand("x", array) == from_array_interface(
        "x", Interface(), array.__array_interface__, NUMPY
    )
