"""cuDNN tensor descriptors through the real library: set, derive, read back, lifetime."""

import ctypes
import gc
import weakref

import pytest

from cudnn_bn._cudnn.enums import BatchNormMode, CudnnDataType
from cudnn_bn._cudnn.tensor import TensorDescriptor
from cudnn_bn.errors import (
    BadParamError,
    BadTensorShapeError,
    BadTensorStridesError,
    InfiniError,
)

F = CudnnDataType.FLOAT

# (shape, strides) given -> (dims, strides) cuDNN holds: ranks below 4 padded with 1s.
LAYOUTS = {
    "NC": ((8, 3), (3, 1), (8, 3, 1, 1), (3, 1, 1, 1)),
    "NCL": ((2, 3, 5), (15, 5, 1), (2, 3, 5, 1), (15, 5, 1, 1)),
    "NCHW": ((2, 3, 4, 5), (60, 20, 5, 1), (2, 3, 4, 5), (60, 20, 5, 1)),
    "NCDHW": ((2, 3, 4, 5, 6), (360, 120, 30, 6, 1), (2, 3, 4, 5, 6), (360, 120, 30, 6, 1)),
    "NHWC": ((2, 3, 4, 5), (60, 1, 15, 3), (2, 3, 4, 5), (60, 1, 15, 3)),
    "NDHWC": ((2, 3, 4, 5, 6), (360, 1, 90, 18, 3), (2, 3, 4, 5, 6), (360, 1, 90, 18, 3)),
    "NLC": ((2, 3, 5), (15, 1, 3), (2, 3, 5, 1), (15, 1, 3, 1)),
    "padded NCL": ((13, 2, 4), (10, 4, 1), (13, 2, 4, 1), (10, 4, 1, 1)),
}


@pytest.mark.parametrize(("shape", "strides", "dims", "held"), LAYOUTS.values(), ids=LAYOUTS)
def test_nd_reads_back(shape, strides, dims, held):
    with TensorDescriptor.nd(F, shape, strides) as desc:
        assert desc.read() == (F, dims, held)


@pytest.mark.parametrize("dtype", CudnnDataType, ids=lambda d: d.name)
def test_each_dtype_reads_back(dtype):
    with TensorDescriptor.nd(dtype, (2, 3, 4, 5), (60, 20, 5, 1)) as desc:
        read_dtype, _, _ = desc.read()
    assert read_dtype is dtype


BN_DTYPES = {  # input dtype -> dtype cuDNN derives for scale/bias/mean/var
    CudnnDataType.HALF: CudnnDataType.FLOAT,
    CudnnDataType.BFLOAT16: CudnnDataType.FLOAT,
    CudnnDataType.FLOAT: CudnnDataType.FLOAT,
    CudnnDataType.DOUBLE: CudnnDataType.DOUBLE,
}


@pytest.mark.parametrize(("dtype", "bn_dtype"), BN_DTYPES.items(), ids=lambda d: d.name)
def test_derive_bn_dtype(dtype, bn_dtype):
    with TensorDescriptor.nd(dtype, (2, 3, 4, 5), (60, 20, 5, 1)) as x:
        bn = TensorDescriptor.derive_bn(x, BatchNormMode.SPATIAL)
    with bn:
        assert bn.read()[0] is bn_dtype


@pytest.mark.parametrize(
    ("shape", "strides", "mode", "bn_shape"),
    [
        ((2, 3, 4, 5), (60, 20, 5, 1), BatchNormMode.SPATIAL, (1, 3, 1, 1)),
        ((2, 3, 4, 5), (60, 1, 15, 3), BatchNormMode.SPATIAL, (1, 3, 1, 1)),
        ((2, 3, 4, 5, 6), (360, 120, 30, 6, 1), BatchNormMode.SPATIAL, (1, 3, 1, 1, 1)),
        ((2, 3, 5), (15, 5, 1), BatchNormMode.SPATIAL, (1, 3, 1, 1)),
        ((2, 3, 4, 5), (60, 20, 5, 1), BatchNormMode.PER_ACTIVATION, (1, 3, 4, 5)),
        ((2, 3, 4, 5), (60, 20, 5, 1), BatchNormMode.SPATIAL_PERSISTENT, (1, 3, 1, 1)),
    ],
)
def test_derive_bn_shape(shape, strides, mode, bn_shape):
    with TensorDescriptor.nd(CudnnDataType.HALF, shape, strides) as x:
        bn = TensorDescriptor.derive_bn(x, mode)
    with bn:
        _, dims, _ = bn.read()
    assert dims == bn_shape


@pytest.mark.parametrize(
    ("shape", "strides", "error"),
    [
        ((2**31, 3, 4, 5), (60, 20, 5, 1), BadTensorShapeError),
        ((2, 3), (2**31, 1), BadTensorStridesError),
        ((2, -3, 4, 5), (60, 20, 5, 1), BadTensorShapeError),
        ((2, 3, 4, 5), (60, 20, 5, -1), BadTensorStridesError),
        ((1,) * 9, (1,) * 9, BadTensorShapeError),
        ((2, 3, 4), (12, 4), BadTensorStridesError),
    ],
)
def test_out_of_range_layout(shape, strides, error):
    with pytest.raises(error):
        TensorDescriptor.nd(F, shape, strides)


@pytest.mark.parametrize("shape", [(0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0)])
def test_zero_size_is_rejected_with_cudnns_message(shape):
    with pytest.raises(InfiniError) as caught:
        TensorDescriptor.nd(F, shape, (60, 20, 5, 1)[-len(shape) :])
    assert "cudnnSetTensorNdDescriptor returned CUDNN_STATUS_BAD_PARAM (2000)" in str(caught.value)
    assert caught.value.status == BadParamError.status


def test_close_twice_is_fine():
    desc = TensorDescriptor.nd(F, (2, 3), (3, 1))
    assert not desc.closed
    desc.close()
    desc.close()
    assert desc.closed
    assert "closed" in repr(desc)


def test_use_after_close_raises():
    desc = TensorDescriptor.nd(F, (2, 3, 4, 5), (60, 20, 5, 1))
    desc.close()
    with pytest.raises((ctypes.ArgumentError, BadParamError)) as caught:
        desc.read()
    assert "BadParamError" in str(caught.value) or isinstance(caught.value, BadParamError)
    with pytest.raises((ctypes.ArgumentError, BadParamError)):
        TensorDescriptor.derive_bn(desc, BatchNormMode.SPATIAL)


def test_context_manager_closes():
    with TensorDescriptor.nd(F, (2, 3), (3, 1)) as desc:
        assert not desc.closed
    assert desc.closed


def test_context_manager_closes_on_error():
    with pytest.raises(RuntimeError), TensorDescriptor.nd(F, (2, 3), (3, 1)) as desc:
        raise RuntimeError
    assert desc.closed


def test_garbage_collection_destroys():
    desc = TensorDescriptor.nd(F, (2, 3), (3, 1))
    finalizer = desc._finalizer
    _, destroy, args, _ = finalizer.peek()
    assert destroy.__name__ == "cudnnDestroyTensorDescriptor"
    assert all(arg is not desc for arg in args), "the finalizer must not keep the object alive"
    alive = weakref.ref(desc)
    del desc
    gc.collect()
    assert alive() is None
    assert not finalizer.alive
