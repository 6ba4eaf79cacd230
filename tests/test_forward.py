"""Training and inference forward on the CPU against PyTorch, and the forward -> backward
round trip through the array API and through ``cudnn_bn.capi`` with host pointers.

References are PyTorch in float64 on the values the operator saw (inputs already rounded to
their dtype): ``F.batch_norm`` for the output and the running-statistics update,
``torch.ops.aten.native_batch_norm`` for the saved mean and invstd, autograd through
``F.batch_norm`` for the backward. Tolerances are ``helpers.TOL``, InfiniCore's own:
2e-5 for F32 (the reference is exact, so this bounds F32 rounding plus accumulation over a
few hundred values), 1e-2 for F16/BF16 (one to a few ulps of a result of magnitude ~1: BF16
has 8 significant bits, eps 7.8e-3).
"""

import ctypes
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    EPS,
    INFERENCE_ORDER,
    OUTPUTS,
    SHAPES,
    TRAINING_ORDER,
    assert_close,
    capi_backward,
    capi_cycle,
    convert,
    f64,
    layout,
    ok,
    random_values,
    tensor_desc,
    tolerance_dtype,
    torch_inference,
    torch_training,
)

from cudnn_bn import (
    InfiniError,
    Status,
    batch_norm_backward,
    batch_norm_forward_inference,
    batch_norm_forward_training,
    capi,
)

HALF = (torch.float16, torch.bfloat16)
# (data dtype, per-channel dtype): one dtype for all, or F32 per-channel tensors for half
# data. Torch dtypes run as torch CPU tensors, NumPy ones as NumPy arrays.
DTYPES = [
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (np.float32, np.float32),
    (np.float64, np.float64),
]
DATA = ("input", "grad_output")


def problem(shape, data, channel, seed=0) -> dict:
    """Input, grad_output and per-channel tensors rounded to their dtypes."""
    values = random_values(shape, seed, bias=True)
    return {name: convert(v, data if name in DATA else channel) for name, v in values.items()}


def copy(array):
    return None if array is None else array.clone() if hasattr(array, "clone") else array.copy()


def torch_autograd(p: dict, eps: float = EPS):
    """float64 ``(grad_input, grad_weight, grad_bias)`` of training ``F.batch_norm``."""
    x, w, b = (f64(p[n]).requires_grad_() for n in ("input", "weight", "bias"))
    y = F.batch_norm(x, None, None, w, b, training=True, eps=eps)
    y.backward(f64(p["grad_output"]))
    return x.grad, w.grad, b.grad


def saved_dtype(data):
    return torch.float32 if data in HALF else data


# --- training forward ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_training_against_torch(data, channel, shape):
    p = problem(shape, data, channel)
    before = {n: copy(p[n]) for n in ("input", "weight", "bias")}
    want = torch_training(p, momentum=0.1)
    got = batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"], momentum=0.1
    )
    assert len(got) == 3
    output, saved_mean, saved_invstd = got
    assert type(output) is type(p["input"])
    assert output.dtype == p["input"].dtype and tuple(output.shape) == shape
    assert saved_mean.dtype == saved_invstd.dtype == saved_dtype(data)
    assert tuple(saved_mean.shape) == tuple(saved_invstd.shape) == (shape[1],)
    tol = tolerance_dtype(data)
    for actual, expected in zip(
        (output, saved_mean, saved_invstd, p["running_mean"], p["running_var"]), want, strict=True
    ):
        assert_close(actual, expected, tol)
    assert p["running_mean"].dtype == channel  # updated in place, in its own dtype
    for name, value in before.items():  # the inputs are left as they were
        np.testing.assert_array_equal(f64(p[name]).numpy(), f64(value).numpy())


@pytest.mark.parametrize("momentum", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("eps", [0.0, EPS, 0.5])
def test_running_update_follows_momentum(momentum, eps):
    """PyTorch's rule: running = (1 - momentum) * running + momentum * batch, unbiased var."""
    p = problem((4, 3, 5), np.float64, np.float64, seed=1)
    old_mean, old_var = p["running_mean"].copy(), p["running_var"].copy()
    want = torch_training(p, momentum, eps)
    got = batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"],
        momentum=momentum, eps=eps,
    )  # fmt: skip
    for actual, expected in zip((*got, p["running_mean"], p["running_var"]), want, strict=True):
        assert_close(actual, expected, np.float64)
    if momentum == 0.0:
        np.testing.assert_array_equal(p["running_mean"], old_mean)
        np.testing.assert_array_equal(p["running_var"], old_var)


@pytest.mark.parametrize("missing", ["running_mean", "running_var", "both"])
def test_running_statistics_may_be_none(missing):
    """A missing running tensor is not updated; everything else is as with both given."""
    p = problem((3, 4, 6), torch.float32, torch.float32)
    want = torch_training(p, momentum=0.2)
    gone = ("running_mean", "running_var") if missing == "both" else (missing,)
    for name in gone:
        p[name] = None
    got = batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"], momentum=0.2
    )
    for actual, expected in zip(got, want[:3], strict=True):
        assert_close(actual, expected, torch.float32)
    for name, expected in zip(("running_mean", "running_var"), want[3:], strict=True):
        if p[name] is not None:
            assert_close(p[name], expected, torch.float32)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_channels_last(shape):
    """NLC / NHWC / NDHWC input: output in the same memory order, values as for packed."""
    p = problem(shape, torch.float32, torch.float32)
    x = p["input"].movedim(1, -1).contiguous().movedim(-1, 1)
    assert x.stride()[1] == 1 and not x.is_contiguous()
    args = (p["weight"], p["bias"], p["running_mean"], p["running_var"])
    output, _, _ = batch_norm_forward_training(x, *args)
    assert output.stride() == x.stride()
    assert_close(output, torch_training(p, momentum=0.1)[0], torch.float32)
    inference = batch_norm_forward_inference(x, *args)
    assert inference.stride() == x.stride()
    assert_close(inference, torch_inference(p), torch.float32)


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1), (1, 3, 1, 1), (1, 3, 1, 1, 1)], ids=str)
def test_training_needs_more_than_one_value_per_channel(shape):
    p = problem(shape, np.float32, np.float32)
    args = (p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"])
    with pytest.raises(InfiniError) as error:
        batch_norm_forward_training(*args)
    assert error.value.status == Status.BAD_TENSOR_SHAPE
    assert_close(batch_norm_forward_inference(*args), torch_inference(p), np.float32)


@pytest.mark.parametrize("momentum", [-0.1, 1.5, math.nan, math.inf, None])
def test_momentum_outside_zero_to_one_is_bad_param(momentum):
    p = problem((2, 3, 4), np.float32, np.float32)
    with pytest.raises(InfiniError) as error:
        batch_norm_forward_training(
            p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"],
            momentum=momentum,
        )  # fmt: skip
    assert error.value.status == Status.BAD_PARAM


# --- inference forward -----------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.0, EPS, 0.5])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_inference_against_torch(data, channel, shape, eps):
    p = problem(shape, data, channel)
    running = copy(p["running_mean"]), copy(p["running_var"])
    output = batch_norm_forward_inference(
        p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"], eps=eps
    )
    assert type(output) is type(p["input"]) and output.dtype == p["input"].dtype
    assert_close(output, torch_inference(p, eps), tolerance_dtype(data))
    for before, after in zip(running, (p["running_mean"], p["running_var"]), strict=True):
        np.testing.assert_array_equal(f64(after).numpy(), f64(before).numpy())  # not updated


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_inference_with_zero_variance_and_eps_is_torchs(data, channel, channels_last):
    """var + eps = 0 makes the scale infinite; torch CPU computes ``x*scale + (bias -
    mean*scale)``, NaN unless x and the mean have opposite signs, where ``(x - mean)*scale``
    is infinite for every x but the mean."""
    values = np.array([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0])
    x = np.stack([values, values, -values, values], axis=1).reshape(6, 4, 1, 1)
    if channels_last:
        x = x.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2)
    p = {
        "input": convert(x, data),
        "weight": convert(np.array([1.0, -2.0, 0.5, 0.0]), channel),
        "bias": convert(np.array([0.5, -1.0, 2.0, 1.0]), channel),
        "running_mean": convert(np.array([1.0, -1.0, 0.0, 2.0]), channel),
        "running_var": convert(np.zeros(4), channel),
    }
    output = batch_norm_forward_inference(
        p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"], eps=0.0
    )
    np.testing.assert_array_equal(f64(output).numpy(), torch_inference(p, 0.0).numpy())


# --- forward -> backward ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_round_trip_equals_torch_autograd(data, channel, shape):
    """The forward's saved mean and invstd go straight into the backward (mode="saved")."""
    p = problem(shape, data, channel)
    out = batch_norm_forward_training(p["input"], p["weight"], p["bias"], None, None)
    grads = batch_norm_backward(
        p["input"], p["grad_output"], p["weight"], None, None,
        mode="saved", saved_mean=out[1], saved_invstd=out[2], reserve=out.reserve,
    )  # fmt: skip
    for actual, expected in zip(grads, torch_autograd(p), strict=True):
        assert_close(actual, expected, tolerance_dtype(data))


# --- the C API -------------------------------------------------------------------------------


def training_arrays(p: dict, data) -> dict:
    """``p`` plus empty, NaN-filled outputs of the forward (saved statistics F32 for half)."""
    shape, c = tuple(p["input"].shape), p["weight"].shape[0]
    stats = saved_dtype(data)
    return {
        **p,
        "output": convert(np.full(shape, np.nan), data),
        "saved_mean": convert(np.full(c, np.nan), stats),
        "saved_invstd": convert(np.full(c, np.nan), stats),
    }


@pytest.mark.parametrize("running", [True, False], ids=["running", "no-running"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_capi_round_trip_equals_torch_autograd(data, channel, shape, running):
    """Forward training, then backward mode 3 (SAVED_INVSTD) on what it saved."""
    p = problem(shape, data, channel)
    want = torch_training(p, momentum=0.25)
    arrays = training_arrays(p, data)
    if not running:
        arrays["running_mean"] = arrays["running_var"] = None
    capi_cycle(
        "BatchNormForwardTraining", TRAINING_ORDER, arrays, (EPS, 0.25), ("Workspace", "Reserve")
    )
    tol = tolerance_dtype(data)
    for name, expected in zip(TRAINING_ORDER[:3] + TRAINING_ORDER[-2:], want, strict=True):
        if arrays[name] is not None:
            assert_close(arrays[name], expected, tol)

    grads = {n: arrays[n] for n in ("input", "grad_output", "weight")}
    grads |= {"running_mean": arrays["saved_mean"], "running_var": arrays["saved_invstd"]}
    grads |= {
        "grad_input": convert(np.full(shape, np.nan), data),
        "grad_weight": convert(np.full(shape[1], np.nan), channel),
        "grad_bias": convert(np.full(shape[1], np.nan), channel),
    }
    capi_backward(grads, mode=3)
    expected = torch_autograd(p)
    for name, value in zip(OUTPUTS, expected, strict=True):
        assert_close(grads[name], value, tol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_capi_inference_against_torch(data, channel, shape):
    p = problem(shape, data, channel)
    arrays = {**p, "output": convert(np.full(shape, np.nan), data)}
    capi_cycle("BatchNormForwardInference", INFERENCE_ORDER, arrays, (0.5,))
    assert_close(arrays["output"], torch_inference(p, eps=0.5), tolerance_dtype(data))


def test_capi_default_attributes_are_eps_1e_5_and_momentum_0_1():
    p = problem((4, 3, 5), np.float64, np.float64)
    want = torch_training(p, momentum=0.1, eps=1e-5)
    arrays = training_arrays(p, np.float64)
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    descs = [tensor_desc(arrays[n]) for n in TRAINING_ORDER]
    ok(capi.infiniopCreateBatchNormForwardTrainingDescriptor(handle, ctypes.byref(op), *descs))
    pointers = [layout(arrays[n])[2] for n in TRAINING_ORDER]
    ok(capi.infiniopBatchNormForwardTraining(op, None, 0, None, 0, *pointers, None))
    for name, expected in zip(TRAINING_ORDER[:3] + TRAINING_ORDER[-2:], want, strict=True):
        assert_close(arrays[name], expected, np.float64)
    ok(capi.infiniopDestroyBatchNormForwardTrainingDescriptor(op))
    for desc in descs:
        ok(capi.infiniopDestroyTensorDescriptor(desc))
    ok(capi.infiniopDestroyHandle(handle))


def test_capi_statuses():
    """Bad attributes, NULL pointers and wrong or destroyed descriptors give their status."""
    arrays = training_arrays(problem((2, 3, 4), np.float32, np.float32), np.float32)
    handle, train, infer = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    descs = {n: tensor_desc(arrays[n]) for n in TRAINING_ORDER}
    ok(
        capi.infiniopCreateBatchNormForwardTrainingDescriptor(
            handle, ctypes.byref(train), *(descs[n] for n in TRAINING_ORDER)
        )
    )
    ok(
        capi.infiniopCreateBatchNormForwardInferenceDescriptor(
            handle, ctypes.byref(infer), *(descs[n] for n in INFERENCE_ORDER)
        )
    )
    null_input = dict(descs, input=None)
    statuses = {
        "momentum < 0": capi.infiniopSetBatchNormForwardTrainingAttributes(train, EPS, -0.5),
        "momentum > 1": capi.infiniopSetBatchNormForwardTrainingAttributes(train, EPS, 2.0),
        "eps < 0": capi.infiniopSetBatchNormForwardTrainingAttributes(train, -1.0, 0.1),
        "inference eps nan": capi.infiniopSetBatchNormForwardInferenceAttributes(infer, math.nan),
        "NULL size": capi.infiniopGetBatchNormForwardTrainingReserveSize(train, None),
        "NULL desc_ptr": capi.infiniopCreateBatchNormForwardTrainingDescriptor(
            handle, None, *(descs[n] for n in TRAINING_ORDER)
        ),
        "NULL input_desc": capi.infiniopCreateBatchNormForwardInferenceDescriptor(
            handle, ctypes.byref(ctypes.c_void_p()), *(null_input[n] for n in INFERENCE_ORDER)
        ),
        "NULL input": capi.infiniopBatchNormForwardTraining(
            train, None, 0, None, 0,
            *(0 if n == "input" else layout(arrays[n])[2] for n in TRAINING_ORDER), None,
        ),
        "inference desc to training": capi.infiniopGetBatchNormForwardTrainingWorkspaceSize(
            infer, ctypes.byref(ctypes.c_size_t())
        ),
    }  # fmt: skip
    assert statuses == {
        "momentum < 0": Status.BAD_PARAM,
        "momentum > 1": Status.BAD_PARAM,
        "eps < 0": Status.BAD_PARAM,
        "inference eps nan": Status.BAD_PARAM,
        "NULL size": Status.NULL_POINTER,
        "NULL desc_ptr": Status.NULL_POINTER,
        "NULL input_desc": Status.NULL_POINTER,
        "NULL input": Status.NULL_POINTER,
        "inference desc to training": Status.BAD_PARAM,
    }
    assert np.isnan(arrays["output"]).all()  # nothing written by the failed compute
    ok(capi.infiniopDestroyBatchNormForwardTrainingDescriptor(train))
    assert capi.infiniopDestroyBatchNormForwardTrainingDescriptor(train) == Status.BAD_PARAM
    assert capi.infiniopDestroyBatchNormForwardInferenceDescriptor(None) == Status.NULL_POINTER
    ok(capi.infiniopDestroyBatchNormForwardInferenceDescriptor(infer))
    for desc in descs.values():
        ok(capi.infiniopDestroyTensorDescriptor(desc))
    ok(capi.infiniopDestroyHandle(handle))
