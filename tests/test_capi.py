"""The C API of ``include/`` on the CPU device: create -> set attributes -> workspace size ->
compute -> destroy with host pointers from NumPy (``arr.ctypes.data``) and torch
(``t.data_ptr()``), against PyTorch's ``native_batch_norm_backward`` in float64.

Every call must return a plain int status, and ``capi.last_error()`` must be empty after
each success. Shapes and strides go in as ctypes arrays, raw addresses of them, Python lists,
or (strides) NULL for contiguous; out-parameters as ``ctypes.byref`` or raw addresses.
"""

import ctypes
import inspect

import numpy as np
import pytest
import torch
from helpers import (
    BACKWARD_ORDER,
    OUTPUTS,
    SHAPES,
    assert_close,
    capi_backward,
    layout,
    ok,
    random_values,
    reference,
    tensor_desc,
)

from cudnn_bn import Status, capi

MODES = {0: "train", 1: "saved", 2: "eval", 3: "saved_invstd"}


def make_problem(shape, data, channel, kind="numpy", seed=0) -> dict:
    """Inputs rounded to their dtypes, and empty outputs, as NumPy arrays or torch tensors."""
    c = shape[1]
    values = random_values(shape, seed) | {
        "grad_input": np.full(shape, np.nan),
        "grad_weight": np.full(c, np.nan),
        "grad_bias": np.full(c, np.nan),
    }
    arrays = {}
    for name, v in values.items():
        dtype = data if name in ("input", "grad_output", "grad_input") else channel
        arrays[name] = v.astype(dtype) if kind == "numpy" else torch.from_numpy(v).to(dtype)
    return arrays


def expected(arrays: dict, mode: int, eps: float = 1e-5):
    a = arrays
    if MODES[mode] == "saved_invstd":
        return reference(
            a["input"],
            a["grad_output"],
            a["weight"],
            mode="saved",
            eps=eps,
            mean=a["running_mean"],
            invstd=a["running_var"],
        )
    return reference(
        a["input"],
        a["grad_output"],
        a["weight"],
        mode=MODES[mode],
        eps=eps,
        mean=a["running_mean"],
        var=a["running_var"],
    )


def check(arrays: dict, want, data) -> None:
    for name, value in zip(OUTPUTS, want, strict=True):
        assert_close(arrays[name], value, data)


# --- the cycle -------------------------------------------------------------------------------


@pytest.mark.parametrize("out", ["byref", "address"])
@pytest.mark.parametrize("style", ["ctypes", "list", "address", "null"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_cycle(kind, mode, style, out):
    data = np.float32 if kind == "numpy" else torch.float32
    arrays = make_problem((2, 3, 5), data, data, kind)
    capi_backward(arrays, mode=mode, style=style, out=out)
    check(arrays, expected(arrays, mode), data)


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    ("data", "channel"),
    [
        (np.float16, np.float16),
        (np.float16, np.float32),
        (np.float64, np.float64),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
    ids=str,
)
def test_dtypes_and_ranks(data, channel, shape, mode):
    kind = "torch" if isinstance(data, torch.dtype) else "numpy"
    arrays = make_problem(shape, data, channel, kind)
    capi_backward(arrays, mode=mode)
    check(arrays, expected(arrays, mode), data if kind == "torch" else np.dtype(data))


def test_default_attributes_are_train_and_eps_1e_5():
    arrays = make_problem((4, 3, 6), np.float32, np.float32)
    capi_backward(arrays, mode=None)
    check(arrays, expected(arrays, 0, eps=1e-5), np.float32)


def test_eps_zero():
    arrays = make_problem((4, 3, 6), np.float64, np.float64)
    capi_backward(arrays, mode=0, eps=0.0)
    check(arrays, expected(arrays, 0, eps=0.0), np.float64)


def test_saved_stats_from_the_torch_forward():
    """Mode 3 takes what ``native_batch_norm`` saved, mean and invstd, as they are."""
    arrays = make_problem((4, 3, 6), torch.float32, torch.float32, "torch")
    _, arrays["running_mean"], arrays["running_var"] = torch.ops.aten.native_batch_norm(
        arrays["input"], arrays["weight"], None, None, None, True, 0.1, 1e-5
    )
    capi_backward(arrays, mode=3, eps=0.5)  # eps is not applied to a saved invstd
    check(arrays, expected(arrays, 0, eps=1e-5), torch.float32)


def test_train_ignores_running_statistics():
    """InfiniCore's generator: random running stats and eps 1e-5, batch statistics expected."""
    first = make_problem((5, 4, 3), np.float32, np.float32, seed=1)
    second = {k: v.copy() for k, v in first.items()}
    second["running_mean"] += 3
    second["running_var"] *= 7
    capi_backward(first, mode=0)
    capi_backward(second, mode=0)
    for name in OUTPUTS:
        np.testing.assert_array_equal(first[name], second[name])
    check(first, expected(first, 0), np.float32)


def test_running_statistics_may_be_null_in_train():
    arrays = make_problem((2, 3, 5), np.float32, np.float32)
    arrays["running_mean"] = arrays["running_var"] = None
    capi_backward(arrays, mode=0)
    check(arrays, reference(arrays["input"], arrays["grad_output"], arrays["weight"]), np.float32)


# --- layouts ---------------------------------------------------------------------------------


def strided(base: np.ndarray, shape, strides) -> np.ndarray:
    b = base.itemsize
    return np.lib.stride_tricks.as_strided(base, shape, tuple(s * b for s in strides))


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_padded_strides(mode):
    """InfiniCore's own case: shape (13, 2, 4), strides (10, 4, 1); the padding of
    grad_input (2 elements of every 10) is left as it was."""
    shape, strides, sentinel = (13, 2, 4), (10, 4, 1), -7.0
    arrays = make_problem(shape, np.float32, np.float32, seed=2)
    bases = {}
    for name in ("input", "grad_output", "grad_input"):
        bases[name] = np.full(130, sentinel, np.float32)
        view = strided(bases[name], shape, strides)
        view[...] = arrays[name]
        arrays[name] = view
    padding = np.arange(130) % 10 >= 8
    capi_backward(arrays, mode=mode, style="list")
    check(arrays, expected(arrays, mode), np.float32)
    assert (bases["grad_input"][padding] == sentinel).all()
    assert not np.isnan(bases["grad_input"][~padding]).any()


def test_strided_per_channel_tensors():
    """Per-channel tensors with stride 2: only every other element of grad_weight is written."""
    arrays = make_problem((3, 4, 5), np.float32, np.float32, seed=3)
    bases = {}
    for name in ("weight", "running_mean", "running_var", "grad_weight", "grad_bias"):
        bases[name] = np.full(8, -7.0, np.float32)
        bases[name][::2] = arrays[name]
        arrays[name] = bases[name][::2]
    capi_backward(arrays, mode=2)
    check(arrays, expected(arrays, 2), np.float32)
    assert (bases["grad_weight"][1::2] == -7.0).all() and (bases["grad_bias"][1::2] == -7.0).all()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_channels_last(kind):
    data = np.float32 if kind == "numpy" else torch.float32
    arrays = make_problem((2, 3, 4, 5), data, data, kind)
    for name in ("input", "grad_output", "grad_input"):
        a = arrays[name]
        arrays[name] = (
            np.moveaxis(np.moveaxis(a, 1, -1).copy(), -1, 1)
            if kind == "numpy"
            else a.contiguous(memory_format=torch.channels_last)
        )
    capi_backward(arrays, mode=0)
    check(arrays, expected(arrays, 0), data)


# --- one descriptor, many calls --------------------------------------------------------------


def test_one_descriptor_many_computes_and_modes():
    """Attributes can change between computes; handles and descriptors go in as ints too."""
    arrays = make_problem((3, 2, 7), np.float64, np.float64, seed=4)
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    descs = [tensor_desc(arrays[n]).value for n in BACKWARD_ORDER]  # plain ints
    ok(capi.infiniopCreateBatchNormBackwardDescriptor(handle.value, ctypes.byref(op), *descs))
    pointers = [ctypes.c_void_p(layout(arrays[n])[2]) for n in BACKWARD_ORDER]
    try:
        for mode, eps in ((0, 1e-5), (2, 1e-3), (1, 0.0), (0, 0.1), (3, 0.0)):
            ok(capi.infiniopSetBatchNormBackwardAttributes(op.value, eps, mode))
            for name in OUTPUTS:
                arrays[name][...] = np.nan
            ok(capi.infiniopBatchNormBackward(op, 0, 0, *pointers, 0))
            check(arrays, expected(arrays, mode, eps), np.float64)
    finally:
        ok(capi.infiniopDestroyBatchNormBackwardDescriptor(op))
        for desc in descs:
            ok(capi.infiniopDestroyTensorDescriptor(desc))
        ok(capi.infiniopDestroyHandle(handle))


# Pointers a compute must refuse (BAD_PARAM), writing nothing, as the array API does: one
# misaligned to its elements, a written one over another argument's memory (results in the
# same place, or an input the second walk reads over-written by the first's grad_weight).
# A data output over a read data tensor is in place instead: exactly, on any engine
# (``test_in_place_as_infinicore``), or anyhow on the CPU engine, which writes it through
# scratch (``test_cpu_engine.py``'s overlap tests).
SPOILED = {
    "grad_input misaligned": {"grad_input": ("grad_input", 2)},
    "input misaligned": {"input": ("input", 1)},
    "grad_weight at grad_bias": {"grad_weight": ("grad_bias", 0)},
    "grad_weight inside input": {"grad_weight": ("input", 8)},
    "grad_bias inside grad_output": {"grad_bias": ("grad_output", 12)},
}


@pytest.mark.parametrize("spoiled", SPOILED.values(), ids=SPOILED)
def test_misaligned_or_overlapping_pointers_are_refused(spoiled):
    arrays = make_problem((3, 2, 7), np.float32, np.float32, seed=5)
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    descs = [tensor_desc(arrays[n]) for n in BACKWARD_ORDER]
    ok(capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(op), *descs))
    address = {n: layout(a)[2] for n, a in arrays.items()}
    pointers = [
        address[spoiled[n][0]] + spoiled[n][1] if n in spoiled else address[n]
        for n in BACKWARD_ORDER
    ]
    before = {n: a.copy() for n, a in arrays.items()}
    try:
        status = capi.infiniopBatchNormBackward(op, 0, 0, *pointers, 0)
        assert status == Status.BAD_PARAM, (Status(status).name, capi.last_error())
        assert set(spoiled) <= set(capi.last_error().split())
        for name, values in before.items():
            np.testing.assert_array_equal(arrays[name], values, err_msg=name)
    finally:
        ok(capi.infiniopDestroyBatchNormBackwardDescriptor(op))
        for desc in descs:
            ok(capi.infiniopDestroyTensorDescriptor(desc))
        ok(capi.infiniopDestroyHandle(handle))


@pytest.mark.parametrize("over", ["grad_output", "input"])
def test_in_place_as_infinicore(over):
    """InfiniCore's own batch_norm_backward tests (test/infiniop, ``Inplace.INPLACE_GRAD_INPUT``)
    pass grad_input at grad_output's address: a data tensor exactly on a read one of its
    layout is in place, element for element, and gives torch's results (the check above
    refused it at first)."""
    arrays = make_problem((3, 2, 7), np.float64, np.float64, seed=6)
    want = expected(arrays, 0)
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    descs = [tensor_desc(arrays[n]) for n in BACKWARD_ORDER]
    ok(capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(op), *descs))
    address = {n: layout(a)[2] for n, a in arrays.items()}
    address["grad_input"] = address[over]
    try:
        ok(capi.infiniopBatchNormBackward(op, 0, 0, *(address[n] for n in BACKWARD_ORDER), 0))
        check(arrays | {"grad_input": arrays[over]}, want, np.float64)
    finally:
        ok(capi.infiniopDestroyBatchNormBackwardDescriptor(op))
        for desc in descs:
            ok(capi.infiniopDestroyTensorDescriptor(desc))
        ok(capi.infiniopDestroyHandle(handle))


def test_last_error_is_cleared_by_a_success():
    size = ctypes.c_size_t()
    status = capi.infiniopGetBatchNormBackwardWorkspaceSize(12345, ctypes.byref(size))
    assert type(status) is int and status == Status.BAD_PARAM
    assert "desc" in capi.last_error()
    handle = ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    ok(capi.infiniopDestroyHandle(handle))
    assert type(capi.infiniopDestroyHandle(handle)) is int


@pytest.mark.parametrize("name", [n for n in dir(capi) if n.startswith("infini")])
def test_every_function_returns_a_plain_int(name):
    """All arguments 0 (NULL): a status as a plain int, never an exception; only
    ``infinirtSetDevice(0, 0)`` (CPU 0) succeeds."""
    function = getattr(capi, name)
    status = function(*[0] * len(inspect.signature(function).parameters))
    assert type(status) is int
    assert (status == Status.SUCCESS) == (name == "infinirtSetDevice"), capi.last_error()
