"""The overflow check of cuDNN's SPATIAL_PERSISTENT passes, on the stub libcudnn.

``check_overflow=True`` (the array API, the operator descriptors) and CuPy 13's ``debug=True``
(``cupyx_compat``) wait for a SPATIAL_PERSISTENT training pass with
``cudnnQueryRuntimeError(handle, &rstatus, CUDNN_ERRQUERY_BLOCKING, NULL)`` on the handle
that ran it, and warn if cuDNN reports anything but success, as CuPy 13 did. Other modes and
engines have nothing to query.
"""

import warnings

import numpy as np
import pytest
from cudnn_stub import (
    F16,
    F32,
    POINTERS,
    SPATIAL,
    SPATIAL_PERSISTENT,
    STREAM,
    STUB_RESERVE,
    WORKSPACE,
)
from helpers import BACKWARD_ORDER, TRAINING_ORDER, channels_last

import cudnn_bn
from cudnn_bn import (
    BatchNormBackwardDescriptor,
    BatchNormForwardTrainingDescriptor,
    Device,
    TensorDesc,
    cupyx_compat,
)
from cudnn_bn.backends import nvidia
from cudnn_bn.ops import descriptor as descriptor_module
from cudnn_bn.tensor import contiguous_strides

ERRQUERY_BLOCKING, RUNTIME_FP_OVERFLOW = 2, 1007  # cudnn_graph.h
SHAPE = (2, 8, 3, 5)
LAYOUTS = {"NHWC": channels_last(SHAPE), "NCHW": contiguous_strides(SHAPE)}


def forward(layout: str, **attrs) -> BatchNormForwardTrainingDescriptor:
    x = TensorDesc(F16, SHAPE, LAYOUTS[layout])
    c = TensorDesc.contiguous(F32, (SHAPE[1],))
    handle = cudnn_bn.Handle(Device.NVIDIA, 0)
    return BatchNormForwardTrainingDescriptor(handle, x, c, c, x, c, c, c, c, **attrs)


def backward(layout: str, **attrs) -> BatchNormBackwardDescriptor:
    x = TensorDesc(F16, SHAPE, LAYOUTS[layout])
    c = TensorDesc.contiguous(F32, (SHAPE[1],))
    handle = cudnn_bn.Handle(Device.NVIDIA, 0)
    return BatchNormBackwardDescriptor(handle, x, c, c, x, x, c, c, c, mode="saved_invstd", **attrs)


def run(desc) -> None:
    if isinstance(desc, BatchNormForwardTrainingDescriptor):
        args = (WORKSPACE, desc.workspace_size, POINTERS["reserve"], STUB_RESERVE)
        desc.compute(*args, *(POINTERS[n] for n in TRAINING_ORDER), stream=STREAM)
    else:
        ptrs = (POINTERS[n] for n in BACKWARD_ORDER)
        desc.compute(WORKSPACE, desc.workspace_size, *ptrs, stream=STREAM)


def call_of(stub, desc):
    """The stub's record of the call ``desc`` makes."""
    forward = isinstance(desc, BatchNormForwardTrainingDescriptor)
    return stub.forward_training if forward else stub.backward


@pytest.mark.parametrize("build", [forward, backward], ids=["forward", "backward"])
def test_persistent_pass_is_checked_on_its_handle(stub, build):
    with build("NHWC", check_overflow=True) as desc:
        assert desc.engine == "cudnn"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run(desc)  # cuDNN reports success: no warning
        query, call = stub.runtime_error, call_of(stub, desc)
        assert (call.calls, query.calls) == (1, 1)
        assert (query.handle, query.mode, query.tag) == (call.handle, ERRQUERY_BLOCKING, 0)
        stub.runtime_error.rstatus = RUNTIME_FP_OVERFLOW
        with pytest.warns(RuntimeWarning, match=r"STUB_STATUS_1007 \(1007\): a numerical overflow"):
            run(desc)
        assert stub.runtime_error.calls == 2


@pytest.mark.parametrize("build", [forward, backward], ids=["forward", "backward"])
@pytest.mark.parametrize(("layout", "check"), [("NHWC", False), ("NCHW", True)])
def test_nothing_is_queried_unless_asked_for_a_persistent_pass(stub, build, layout, check):
    """Off by default (it synchronizes); SPATIAL (NCHW) kernels do not flag overflows."""
    with build(layout, check_overflow=check) as desc:
        run(desc)
        assert call_of(stub, desc).calls == 1
    assert stub.runtime_error.calls == 0


def test_check_overflow_must_be_a_bool(stub):
    with pytest.raises(cudnn_bn.InfiniError, match="check_overflow"):
        forward("NHWC", check_overflow="yes")


@pytest.mark.parametrize("debug", [True, False])
def test_cupyx_compat_debug_does_what_cupy13_did(stub, monkeypatch, debug):
    """``debug=True`` on a SPATIAL_PERSISTENT pass queries and warns (cuDNN is the stub here:
    host arrays are sent to the NVIDIA backend; the outputs are whatever the stub left)."""
    monkeypatch.setattr(descriptor_module, "backend_class", lambda _, op: getattr(nvidia, op))
    stub.runtime_error.rstatus = RUNTIME_FP_OVERFLOW
    n, h, w, c = 2, 3, 5, 8
    x = np.zeros((n, h, w, c), np.float16)
    gamma, beta = np.ones(c, np.float32), np.zeros(c, np.float32)
    args = (x, gamma, beta, None, None, None, None, 1e-5, 0.9, True)
    persistent, nhwc = (
        cupyx_compat.CUDNN_BATCHNORM_SPATIAL_PERSISTENT,
        cupyx_compat.CUDNN_TENSOR_NHWC,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reserve, _, mean, inv_std = cupyx_compat.batch_normalization_forward_training_ex(
            *args, persistent, debug, nhwc
        )
        backward = (x, gamma, x, mean, inv_std, 1e-5, True, persistent, debug, nhwc)
        cupyx_compat.batch_normalization_backward(*backward, reserve_space=reserve)
        assert stub.backward.mode == SPATIAL_PERSISTENT
        # Without the forward's reserve the backward runs in SPATIAL: nothing to check.
        cupyx_compat.batch_normalization_backward(*backward)
        assert stub.backward.mode == SPATIAL
    assert (stub.forward_training.calls, stub.backward.calls) == (1, 2)
    assert stub.runtime_error.calls == (2 if debug else 0)
    overflows = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(overflows) == (2 if debug else 0)
