"""The C API takes what ctypes would pass to a C function with the headers' prototypes.

Scalars as Python numbers, NumPy scalars or ctypes values (``c_double``, ``c_float``,
``c_int``, ``c_size_t``, ``c_uint64``, the very ``c_size_t`` a size query filled); pointers
as ``byref``, ``pointer``, arrays or addresses. Whatever ctypes would refuse (``str`` or
``bytes`` out-parameters, pointers to the wrong type, keyword arguments, a wrong argument
count) is a status naming the argument, with nothing written and nothing registered.
"""

import ctypes
import fractions
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    BACKWARD_ORDER,
    OUTPUTS,
    assert_close,
    layout,
    ok,
    random_values,
    reference,
    tensor_desc,
)

from cudnn_bn import DataType, Device, Status, capi, runtime

F32 = int(DataType.F32)


def make_problem(shape, dtype, seed=0) -> dict:
    """The backward's arguments by name: random inputs, NaN outputs."""
    c = shape[1]
    arrays = random_values(shape, seed) | {
        "grad_input": np.full(shape, np.nan),
        "grad_weight": np.full(c, np.nan),
        "grad_bias": np.full(c, np.nan),
    }
    return {name: value.astype(dtype) for name, value in arrays.items()}


def _status(status: int, expected: Status, *words: str) -> None:
    assert type(status) is int
    assert status == expected, capi.last_error()
    for word in words:
        assert word in capi.last_error()


def _handle() -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    return handle


SCALARS = {  # eps, mode, workspace size as a caller may spell them
    "python": (lambda v: v, lambda v: v),
    "ctypes": (ctypes.c_double, ctypes.c_int),
    "ctypes_narrow": (ctypes.c_float, ctypes.c_long),
    "numpy": (np.float32, np.int64),
}


@pytest.mark.parametrize("form", SCALARS)
def test_backward_cycle_with_scalar_forms(form):
    """InfiniCore's Python tests pass eps as ``c_double``/``c_float`` and sizes as the
    ``c_size_t`` the query filled; results must be torch's."""
    real, integer = SCALARS[form]
    arrays = make_problem((3, 2, 5), np.float64, seed=5)
    handle, op = _handle(), ctypes.c_void_p()
    descs = [tensor_desc(arrays[n]) for n in BACKWARD_ORDER]
    ok(capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(op), *descs))
    ok(capi.infiniopSetBatchNormBackwardAttributes(op, real(0.5), integer(2)))
    size = ctypes.c_size_t(7)
    ok(capi.infiniopGetBatchNormBackwardWorkspaceSize(op, ctypes.byref(size)))
    pointers = [layout(arrays[n])[2] for n in BACKWARD_ORDER]
    ok(capi.infiniopBatchNormBackward(op, None, size, *pointers, None))
    ok(capi.infiniopBatchNormBackward(op, None, ctypes.c_uint64(0), *pointers, None))
    want = reference(
        arrays["input"],
        arrays["grad_output"],
        arrays["weight"],
        mode="eval",
        eps=float(np.float32(0.5)),
        mean=arrays["running_mean"],
        var=arrays["running_var"],
    )
    for name, value in zip(OUTPUTS, want, strict=True):
        assert_close(arrays[name], value, np.float64)
    for desc in descs:
        ok(capi.infiniopDestroyTensorDescriptor(desc))
    ok(capi.infiniopDestroyBatchNormBackwardDescriptor(op))
    ok(capi.infiniopDestroyHandle(handle))


def test_training_attributes_take_ctypes_floats():
    arrays = {
        "output": np.zeros((2, 3), np.float32),
        "saved_mean": np.zeros(3, np.float32),
        "saved_invstd": np.zeros(3, np.float32),
        "input": np.arange(6, dtype=np.float32).reshape(2, 3),
        "weight": np.ones(3, np.float32),
        "bias": np.zeros(3, np.float32),
        "running_mean": np.zeros(3, np.float32),
        "running_var": np.ones(3, np.float32),
    }
    handle, op = _handle(), ctypes.c_void_p()
    descs = [tensor_desc(a) for a in arrays.values()]
    ok(capi.infiniopCreateBatchNormForwardTrainingDescriptor(handle, ctypes.byref(op), *descs))
    ok(capi.infiniopSetBatchNormForwardTrainingAttributes(op, ctypes.c_float(0.0), 0.5))
    ok(capi.infiniopSetBatchNormForwardTrainingAttributes(op, 1e-5, ctypes.c_double(0.5)))
    size = ctypes.c_size_t()
    ok(capi.infiniopGetBatchNormForwardTrainingReserveSize(op, ctypes.pointer(size)))
    pointers = [a.ctypes.data for a in arrays.values()]
    ok(capi.infiniopBatchNormForwardTraining(op, 0, size, 0, size, *pointers, 0))
    np.testing.assert_allclose(arrays["running_mean"], [0.75, 1.25, 1.75])  # 0.5 * mean
    ok(capi.infiniopDestroyBatchNormForwardTrainingDescriptor(op))
    ok(capi.infiniopDestroyHandle(handle))


def test_tensor_descriptor_takes_ctypes_scalars_and_arrays():
    desc = ctypes.c_void_p()
    shape, strides = (ctypes.c_size_t * 2)(2, 3), (ctypes.c_ssize_t * 2)(3, 1)
    ok(
        capi.infiniopCreateTensorDescriptor(
            ctypes.pointer(desc), ctypes.c_size_t(2), shape, strides, ctypes.c_int(F32)
        )
    )
    ok(capi.infiniopDestroyTensorDescriptor(desc))
    ok(capi.infiniopCreateTensorDescriptor(ctypes.byref(desc), np.uint64(2), shape, None, 13))
    ok(capi.infiniopDestroyTensorDescriptor(desc))
    ok(capi.infinirtSetDevice(ctypes.c_int(int(Device.CPU)), np.int32(0)))


def test_keyword_arguments_and_wrong_counts_are_bad_param():
    handle = ctypes.c_void_p()
    _status(
        capi.infiniopCreateHandle(handle_ptr=ctypes.byref(handle)), Status.BAD_PARAM, "handle_ptr"
    )
    _status(capi.infiniopCreateHandle(), Status.BAD_PARAM, "handle_ptr", "1 arguments")
    _status(capi.infiniopDestroyHandle(1, 2), Status.BAD_PARAM, "infiniopDestroyHandle", "got 2")
    _status(
        capi.infiniopSetBatchNormBackwardAttributes(0, eps=1e-5, mode=0), Status.BAD_PARAM, "eps"
    )
    assert handle.value is None


@pytest.mark.parametrize("bad", [b"\xff" * 16, "out-parameter", bytearray(16), 3.5])
def test_str_and_bytes_are_never_written_through(bad):
    before = bytes(bad) if isinstance(bad, bytes | bytearray) else bad
    _status(capi.infiniopCreateHandle(bad), Status.BAD_PARAM, "handle_ptr")
    desc = ctypes.c_void_p()
    ok(capi.infiniopCreateTensorDescriptor(ctypes.byref(desc), 1, [3], None, F32))
    _status(capi.infiniopGetBatchNormBackwardWorkspaceSize(desc, bad), Status.BAD_PARAM, "size")
    _status(capi.infiniopCreateTensorDescriptor(bad, 1, [3], None, F32), Status.BAD_PARAM)
    ok(capi.infiniopDestroyTensorDescriptor(desc))
    assert (bytes(bad) if isinstance(bad, bytes | bytearray) else bad) == before


@pytest.mark.parametrize(
    "target",
    [ctypes.c_int(7), ctypes.c_float(7), (ctypes.c_char * 4)()],
    ids=["c_int", "c_float", "char[4]"],
)
def test_out_parameter_of_the_wrong_type_is_refused(target):
    before = bytes(target)
    _status(capi.infiniopCreateHandle(ctypes.byref(target)), Status.BAD_PARAM, "handle_ptr")
    _status(capi.infiniopCreateHandle(ctypes.pointer(target)), Status.BAD_PARAM, "handle_ptr")
    assert bytes(target) == before


def test_out_parameter_without_room_is_refused():
    """``byref(obj, offset)`` past the end of ``obj`` and a handle passed as an address."""
    room = (ctypes.c_void_p * 1)()
    _status(capi.infiniopCreateHandle(ctypes.byref(room, 4)), Status.BAD_PARAM, "room")
    handle = _handle()
    _status(capi.infiniopCreateHandle(handle.value), Status.BAD_PARAM, "not a host address")
    _status(capi.infiniopCreateHandle(0x1234), Status.BAD_PARAM, "not a host address")
    ok(capi.infiniopDestroyHandle(handle))


def test_a_failed_create_registers_nothing():
    live = len(capi._objects)
    for _ in range(50):
        assert capi.infiniopCreateHandle(None) == Status.NULL_POINTER
        assert capi.infiniopCreateTensorDescriptor(None, 1, [3], None, F32) == Status.NULL_POINTER
        assert capi.infiniopCreateTensorDescriptor(0, 1, [3], None, F32) == Status.NULL_POINTER
    handle, desc = _handle(), ctypes.c_void_p()
    ok(capi.infiniopCreateTensorDescriptor(ctypes.byref(desc), 1, [3], None, F32))
    live += 2
    for _ in range(50):  # the operator is built, then the NULL out-parameter refused
        status = capi.infiniopCreateBatchNormBackwardDescriptor(handle, None, *[desc] * 8)
        assert status == Status.NULL_POINTER
    assert len(capi._objects) == live
    ok(capi.infiniopDestroyTensorDescriptor(desc))
    ok(capi.infiniopDestroyHandle(handle))


@pytest.mark.parametrize(
    ("shape", "strides", "dtype", "expected"),
    [
        ([2, 3], None, int(DataType.INVALID), Status.BAD_TENSOR_DTYPE),
        ([2, 3], None, 9, Status.SUCCESS),  # U32: a real element type, refused by operators
        ([2, 3], None, 20, Status.BAD_TENSOR_DTYPE),
        ([2**63, 1], None, F32, Status.BAD_TENSOR_SHAPE),
        ([2**64 - 1], None, F32, Status.BAD_TENSOR_SHAPE),
        ([2**31, 2**31], None, F32, Status.BAD_TENSOR_SHAPE),
        ([2, 3], [2**62, 1], F32, Status.BAD_TENSOR_STRIDES),
        ([2, 3], [2**63, 1], F32, Status.BAD_TENSOR_STRIDES),
        ([0, 3], [2**62, 1], F32, Status.SUCCESS),  # addresses nothing
        ([2, 3], [-(2**61), 1], F32, Status.BAD_TENSOR_STRIDES),
    ],
)
def test_tensor_descriptors_no_buffer_can_hold_are_refused_at_create(
    shape, strides, dtype, expected
):
    desc = ctypes.c_void_p()
    status = capi.infiniopCreateTensorDescriptor(
        ctypes.byref(desc), len(shape), shape, strides, dtype
    )
    _status(status, expected)
    if expected == Status.SUCCESS:
        ok(capi.infiniopDestroyTensorDescriptor(desc))
    else:
        assert desc.value is None


def test_c_size_t_arrays_read_as_unsigned():
    """A shape entry >= 2**63 in a ``size_t`` array is refused, not read as negative."""
    desc = ctypes.c_void_p()
    shape = (ctypes.c_size_t * 2)(2**64 - 2, 3)
    _status(
        capi.infiniopCreateTensorDescriptor(ctypes.byref(desc), 2, shape, None, F32),
        Status.BAD_TENSOR_SHAPE,
    )
    short = (ctypes.c_size_t * 1)(3)
    _status(
        capi.infiniopCreateTensorDescriptor(ctypes.byref(desc), 2, short, None, F32),
        Status.BAD_PARAM,
        "shape",
    )


def test_failed_set_device_fails_the_next_create_handle(monkeypatch):
    """Issue 12: after ``infinirtSetDevice(NVIDIA, 0)`` fails, ``infiniopCreateHandle`` fails
    with its status instead of handing out a handle for the CPU."""
    from cudnn_bn.backends import cuda
    from cudnn_bn.errors import InfiniError

    def no_driver() -> int:
        raise InfiniError(Status.DEVICE_NOT_INITIALIZED, "cudaGetDeviceCount failed")

    monkeypatch.setattr(cuda, "device_count", no_driver)
    handle = ctypes.c_void_p()
    try:
        _status(capi.infinirtSetDevice(int(Device.NVIDIA), 0), Status.DEVICE_NOT_INITIALIZED)
        _status(
            capi.infiniopCreateHandle(ctypes.byref(handle)),
            Status.DEVICE_NOT_INITIALIZED,
            "infinirtSetDevice",
        )
        assert handle.value is None
        _status(capi.infinirtSetDevice(99, 0), Status.DEVICE_TYPE_NOT_SUPPORTED)
        _status(capi.infiniopCreateHandle(ctypes.byref(handle)), Status.DEVICE_TYPE_NOT_SUPPORTED)
    finally:
        ok(capi.infinirtSetDevice(int(Device.CPU), 0))
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    assert runtime.current_handle().device == Device.CPU
    ok(capi.infiniopDestroyHandle(handle))


def test_cpu_data_pointers_must_be_host_addresses():
    arrays = make_problem((2, 3, 4), np.float32)
    handle, op = _handle(), ctypes.c_void_p()
    descs = [tensor_desc(arrays[n]) for n in BACKWARD_ORDER]
    ok(capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(op), *descs))
    pointers = [layout(arrays[n])[2] for n in BACKWARD_ORDER]
    before = arrays["grad_input"].copy()
    bad = [*pointers]
    bad[0] = 0x100
    _status(capi.infiniopBatchNormBackward(op, 0, 0, *bad, 0), Status.BAD_PARAM, "grad_input")
    bad[0] = op.value  # a descriptor is no address
    _status(capi.infiniopBatchNormBackward(op, 0, 0, *bad, 0), Status.BAD_PARAM, "grad_input")
    np.testing.assert_array_equal(arrays["grad_input"], before)
    ok(capi.infiniopBatchNormBackward(op, 0, 0, *pointers, 1))  # a stream is not read
    ok(capi.infiniopDestroyBatchNormBackwardDescriptor(op))
    ok(capi.infiniopDestroyHandle(handle))


class _Raises:
    """A caller's object whose conversion to a C value raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __index__(self) -> int:
        raise self.error

    def __float__(self) -> float:
        raise self.error


@pytest.mark.parametrize(
    ("operator", "attributes", "bad"),
    [
        ("BatchNormBackward", (10**400, 0), "eps"),
        ("BatchNormBackward", (-(10**400), 0), "eps"),
        ("BatchNormBackward", (1e-5, 10**400), "mode"),
        ("BatchNormForwardTraining", (10**400, 0.1), "eps"),
        ("BatchNormForwardTraining", (1e-5, fractions.Fraction(10**400)), "momentum"),
        ("BatchNormForwardInference", (10**400,), "eps"),
    ],
)
def test_numbers_no_c_type_holds_are_bad_param(operator, attributes, bad):
    """``eps = 10**400``: ctypes refuses it (OverflowError), so a BAD_PARAM naming eps, not
    INTERNAL_ERROR (issue 16, finding 13)."""
    desc = ctypes.c_void_p(0x1234_5678)  # never looked up: the conversion fails first
    status = getattr(capi, f"infiniopSet{operator}Attributes")(desc, *attributes)
    _status(status, Status.BAD_PARAM, bad)


@pytest.mark.parametrize("error", [ValueError("no"), OverflowError("big"), ZeroDivisionError()])
@pytest.mark.parametrize("where", ["ndim", "shape_entry", "dtype", "desc_ptr", "size"])
def test_a_conversion_the_callers_object_fails_is_bad_param(where, error):
    """What the caller's object raises while it is converted is a BAD_PARAM naming the
    parameter, with nothing written."""
    desc, bad = ctypes.c_void_p(), _Raises(error)
    args = {"desc_ptr": ctypes.byref(desc), "ndim": 2, "shape": [2, 3], "dtype": F32}
    name = where
    if where == "shape_entry":
        args["shape"], name = [2, bad], "shape"
    elif where == "size":
        args["shape"], name = bad, "shape"
    else:
        args[where] = bad
    status = capi.infiniopCreateTensorDescriptor(
        args["desc_ptr"], args["ndim"], args["shape"], None, args["dtype"]
    )
    _status(status, Status.BAD_PARAM, name)
    assert desc.value is None


def test_the_callers_timeout_passes_through():
    """A signal handler's ``TimeoutError`` raised inside a call is the caller's own."""
    with pytest.raises(TimeoutError):
        capi.infiniopCreateTensorDescriptor(None, _Raises(TimeoutError()), [2], None, F32)


_UNUSABLE_MEMORY_SCRIPT = """
import ctypes, mmap, sys
import numpy as np
from cudnn_bn import DataType, Device, capi

page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ if sys.argv[1] == "read-only" else 0)
address = np.frombuffer(page, np.uint8).ctypes.data
F32 = int(DataType.F32)
assert capi.infinirtSetDevice(Device.CPU, 0) == 0
handle, desc, data, op = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
assert capi.infiniopCreateHandle(ctypes.byref(handle)) == 0
assert capi.infiniopCreateTensorDescriptor(ctypes.byref(desc), 1, [3], None, F32) == 0
assert capi.infiniopCreateTensorDescriptor(ctypes.byref(data), 3, [2, 3, 4], None, F32) == 0
descs = [data, desc, desc, data, data, desc, desc, desc]
assert capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(op), *descs) == 0
calls = {
    "handle_ptr": lambda: capi.infiniopCreateHandle(address),
    "desc_ptr": lambda: capi.infiniopCreateTensorDescriptor(address, 1, [3], None, F32),
    "size": lambda: capi.infiniopGetBatchNormBackwardWorkspaceSize(op, address),
}
create = capi.infiniopCreateTensorDescriptor
if sys.argv[1] == "no-access":  # read: the shape and strides arrays
    calls["shape"] = lambda: create(ctypes.byref(desc), 2, address, None, F32)
    calls["strides"] = lambda: create(ctypes.byref(desc), 2, [2, 3], address, F32)
for name, call in calls.items():
    print(name, call(), capi.last_error(), flush=True)
"""


@pytest.mark.parametrize("page", ["read-only", "no-access"])
def test_an_address_of_memory_the_process_cannot_use_is_bad_param(page):
    """An out-parameter given as the address of memory this process cannot write (a
    read-only or inaccessible page), or a shape or strides array at one it cannot read, is
    BAD_PARAM naming it, never a crash: the address is in the host's range, so it was
    written or read, and the process died of SIGSEGV (found by an outsider's attack)."""
    child = subprocess.run(
        [sys.executable, "-c", _UNUSABLE_MEMORY_SCRIPT, page], capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
    )  # fmt: skip
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-2000:])
    lines = child.stdout.splitlines()
    assert len(lines) == (5 if page == "no-access" else 3), child.stdout
    for line in lines:
        name, status, message = line.split(" ", 2)
        assert int(status) == Status.BAD_PARAM and name in message, line
