"""Every bad input of the contract, through both the array API and the C API, on the CPU device.

One table of cases. Each case says the status it must produce, which argument the message
must name, and how it spoils a good problem: for the array API (``batch_norm_backward``
raises ``InfiniError`` with that status; the inputs are left as they were), for the C API
(the first failing call returns that status as a plain int, ``capi.last_error()`` names the
argument, and grad_input/grad_weight/grad_bias, pre-filled with a sentinel byte together
with a margin around them, are untouched), or for both.
"""

import ctypes
import math
import numbers
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from helpers import BACKWARD_ORDER, OUTPUTS, gpu_present
from hypothesis import given, settings
from hypothesis import strategies as st

import cudnn_bn
from cudnn_bn import DataType, Device, InfiniError, Status, capi
from cudnn_bn.backends import cpu
from cudnn_bn.nn import BatchNorm
from cudnn_bn.tensor import contiguous_strides

N, C, L = 2, 3, 4
SHAPE = (N, C, L)
F16, F32, F64, I32 = DataType.F16, DataType.F32, DataType.F64, DataType.I32
BF16 = DataType.BF16
STORAGE = {F16: np.float16, BF16: np.uint16, F32: np.float32, F64: np.float64, I32: np.int32}
SENTINEL = 0xA5

DATA = ("grad_input", "input", "grad_output")
PER_CHANNEL = ("grad_weight", "grad_bias", "weight", "running_mean", "running_var")
POSITIONAL = ("input", "grad_output", "weight", "running_mean", "running_var")


def names(argument: str) -> str:
    """A pattern for ``argument`` (or ``argument_desc``) as a whole word: ``weight`` does not
    match ``grad_weight_desc``."""
    return rf"(?<![\w]){argument}(_desc)?\b"


# --- the array API's side ----------------------------------------------------------------


def array_args() -> dict:
    """A good float32 problem for ``batch_norm_backward``: positional and keyword arguments."""
    rng = np.random.default_rng(0)
    return {
        "input": rng.standard_normal(SHAPE).astype(np.float32),
        "grad_output": rng.standard_normal(SHAPE).astype(np.float32),
        "weight": rng.uniform(0.5, 1.5, C).astype(np.float32),
        "running_mean": rng.standard_normal(C).astype(np.float32),
        "running_var": rng.uniform(0.5, 1.5, C).astype(np.float32),
        "eps": 1e-5,
        "mode": "train",
    }


def call_array(args: dict):
    keywords = {k: v for k, v in args.items() if k not in POSITIONAL}
    return cudnn_bn.batch_norm_backward(*(args[k] for k in POSITIONAL), **keywords)


def arrays(**changes: object) -> Callable[[dict], None]:
    """An edit of ``array_args()``: each value is a replacement, or a function of the args."""

    def edit(args: dict) -> None:
        args.update({k: v(args) if callable(v) else v for k, v in changes.items()})

    return edit


def saved_statistics(mode: str = "saved", **saved: object) -> Callable[[dict], None]:
    """An edit of ``array_args()``: ``saved`` (saved_mean, saved_invstd) instead of the running
    statistics, in ``mode``."""
    return arrays(mode=mode, running_mean=None, running_var=None, **saved)


class OnCuda:
    """Claims to be a float32 array on CUDA device 0 (never read: validation stops first)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": "<f4",
            "data": (0xDEAD0000, False),
            "strides": None,
            "version": 3,
        }


# --- the C API's side --------------------------------------------------------------------


def default_spec(name: str) -> tuple[DataType, tuple[int, ...], tuple[int, ...] | None]:
    return (F32, SHAPE, None) if name in DATA else (F32, (C,), None)


@dataclass
class CapiProblem:
    """One pass through the C API: set device, handle, tensor descriptors, create, set
    attributes, workspace size, compute, destroy. Each field is one way to spoil it."""

    descs: dict = field(default_factory=lambda: {n: default_spec(n) for n in BACKWARD_ORDER})
    device: tuple[int, int] = (Device.CPU, 0)
    handle: int | None = None  # a value to pass instead of the real handle
    eps: object = 1e-5
    mode: int = 0
    null_data: tuple[str, ...] = ()  # data pointers passed as NULL to compute
    null_out: str = ""  # "desc_ptr" or "size": that out-parameter passed as NULL
    destroyed_tensor: str = ""  # destroyed before the operator descriptor is created
    destroy_first: bool = False  # compute with a destroyed operator descriptor
    destroy_twice: bool = False


def descs(**changes: object) -> Callable[[CapiProblem], None]:
    """An edit of the tensor descriptors: ``name=(dtype, shape, strides)`` or None (NULL)."""
    return lambda p: p.descs.update(changes)


def attrs(**changes: object) -> Callable[[CapiProblem], None]:
    """An edit of the other fields of ``CapiProblem``."""
    return lambda p: p.__dict__.update(changes)


class Buffer:
    """Host memory for one tensor, with a margin of the tensor's own span on either side, so
    that a wrong stride or offset stays in memory we own and shows in the sentinel check."""

    def __init__(self, spec, output: bool, rng: np.random.Generator) -> None:
        dtype, shape, strides = spec
        strides = contiguous_strides(shape) if strides is None else strides
        span = 1 + sum(abs(s) * (n - 1) for n, s in zip(shape, strides, strict=True) if n)
        self.data = np.empty(3 * span, STORAGE[dtype])
        if output:
            self.data.view(np.uint8)[:] = SENTINEL
        else:
            self.data[:] = rng.uniform(0.5, 1.5, self.data.size)
        self.ptr = self.data.ctypes.data + span * self.data.itemsize

    def untouched(self) -> bool:
        return bool((self.data.view(np.uint8) == SENTINEL).all())


@dataclass
class Outcome:
    stage: str  # the call that failed, or "done"
    status: int
    message: str


class _Stop(Exception):
    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome


def _check(stage: str, status: int) -> None:
    assert type(status) is int, f"{stage} returned {type(status).__name__}, not int"
    if status != Status.SUCCESS:
        raise _Stop(Outcome(stage, status, capi.last_error()))
    assert capi.last_error() == ""


def run_capi(p: CapiProblem) -> tuple[Outcome, dict[str, Buffer]]:
    """Run ``p`` until the first failing call; always release what was created."""
    rng = np.random.default_rng(0)
    buffers = {
        name: Buffer(p.descs[name] or default_spec(name), name in OUTPUTS, rng)
        for name in BACKWARD_ORDER
    }
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    tensors: dict[str, ctypes.c_void_p | None] = {}
    op_live = False
    try:
        _check("infinirtSetDevice", capi.infinirtSetDevice(*p.device))
        _check("infiniopCreateHandle", capi.infiniopCreateHandle(ctypes.byref(handle)))
        for name in BACKWARD_ORDER:
            if p.descs[name] is None:
                tensors[name] = None
                continue
            dtype, shape, strides = p.descs[name]
            tensors[name] = ctypes.c_void_p()
            _check(
                "infiniopCreateTensorDescriptor",
                capi.infiniopCreateTensorDescriptor(
                    ctypes.byref(tensors[name]),
                    len(shape),
                    (ctypes.c_size_t * len(shape))(*shape),
                    None if strides is None else (ctypes.c_int64 * len(shape))(*strides),
                    dtype,
                ),
            )
        if p.destroyed_tensor:
            capi.infiniopDestroyTensorDescriptor(tensors[p.destroyed_tensor])
        _check(
            "create",
            capi.infiniopCreateBatchNormBackwardDescriptor(
                handle if p.handle is None else p.handle,
                None if p.null_out == "desc_ptr" else ctypes.byref(op),
                *(tensors[name] for name in BACKWARD_ORDER),
            ),
        )
        op_live = True
        _check("attributes", capi.infiniopSetBatchNormBackwardAttributes(op, p.eps, p.mode))
        size = ctypes.c_size_t()
        _check(
            "workspace",
            capi.infiniopGetBatchNormBackwardWorkspaceSize(
                op, None if p.null_out == "size" else ctypes.byref(size)
            ),
        )
        workspace = np.empty(max(size.value, 1), np.uint8)
        if p.destroy_first:
            op_live = False
            _check("destroy", capi.infiniopDestroyBatchNormBackwardDescriptor(op))
        pointers = [0 if name in p.null_data else buffers[name].ptr for name in BACKWARD_ORDER]
        _check(
            "compute",
            capi.infiniopBatchNormBackward(op, workspace.ctypes.data, size.value, *pointers, None),
        )
        op_live = False
        _check("destroy", capi.infiniopDestroyBatchNormBackwardDescriptor(op))
        if p.destroy_twice:
            _check("destroy", capi.infiniopDestroyBatchNormBackwardDescriptor(op))
        return Outcome("done", Status.SUCCESS, ""), buffers
    except _Stop as stop:
        return stop.outcome, buffers
    finally:
        if op_live:
            capi.infiniopDestroyBatchNormBackwardDescriptor(op)
        for name, desc in tensors.items():
            if desc is not None and name != p.destroyed_tensor:
                capi.infiniopDestroyTensorDescriptor(desc)
        if handle.value:
            capi.infiniopDestroyHandle(handle)
        capi.infinirtSetDevice(Device.CPU, 0)


# --- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    status: Status
    pattern: str  # what the message must contain (a regex; ``names(arg)`` for an argument)
    array: Callable[[dict], None] | None = None  # how the array API's call is spoiled
    capi: Callable[[CapiProblem], None] | None = None  # how the C API's pass is spoiled
    stage: str = "create"  # the C-API call that must fail


def _data_shape_cases() -> list[Case]:
    cases = []
    for label, shape in (
        ("1-D", (N * C * L,)),
        ("6-D", (N, C, 2, 1, 2, 1)),
        ("zero-channel", (N, 0, L)),
    ):
        cases.append(
            Case(
                f"input {label}",
                Status.BAD_TENSOR_SHAPE,
                names("input"),
                arrays(input=np.ones(shape, np.float32), grad_output=np.ones(shape, np.float32)),
                descs(**{n: (F32, shape, None) for n in DATA}),
            )
        )
    return cases


def _per_channel_cases() -> list[Case]:
    cases = []
    for name in PER_CHANNEL:
        as_array = name not in OUTPUTS
        for shape in ((C + 1,), (C, 1), ()):
            cases.append(
                Case(
                    f"{name} shape {shape}",
                    Status.BAD_TENSOR_SHAPE,
                    names(name),
                    arrays(**{name: np.ones(shape, np.float32)}) if as_array else None,
                    descs(**{name: (F32, shape, None)}),
                )
            )
        cases += [
            Case(
                f"{name} stride 0",
                Status.BAD_TENSOR_STRIDES,
                names(name),
                arrays(**{name: np.broadcast_to(np.float32(1), (C,))}) if as_array else None,
                descs(**{name: (F32, (C,), (0,))}),
            ),
            Case(
                f"{name} negative stride",
                Status.BAD_TENSOR_STRIDES,
                names(name),
                arrays(**{name: lambda a, n=name: a[n][::-1]}) if as_array else None,
                descs(**{name: (F32, (C,), (-1,))}),
            ),
            Case(
                f"F16 {name} with F32 input",
                Status.BAD_TENSOR_DTYPE,
                names(name),
                arrays(**{name: np.ones(C, np.float16)}) if as_array else None,
                descs(**{name: (F16, (C,), None)}),
            ),
            Case(
                f"F64 {name} with F32 input",
                Status.BAD_TENSOR_DTYPE,
                names(name),
                arrays(**{name: np.ones(C, np.float64)}) if as_array else None,
                descs(**{name: (F64, (C,), None)}),
            ),
        ]
    return cases


def _null_cases() -> list[Case]:
    cases = []
    for name in BACKWARD_ORDER[:6]:
        # The array API takes weight=None as affine=False (test_affine.py); the C API does not.
        as_array = name not in OUTPUTS and name != "weight"
        cases += [
            Case(
                f"{name}_desc NULL",
                Status.NULL_POINTER,
                names(name),
                arrays(**{name: None}) if as_array else None,
                descs(**{name: None}),
            ),
            Case(
                f"{name} data NULL",
                Status.NULL_POINTER,
                names(name),
                None,
                attrs(null_data=(name,)),
                stage="compute",
            ),
        ]
    for name in ("running_mean", "running_var"):
        for mode, label in ((1, "saved"), (2, "eval")):
            cases += [
                Case(
                    f"{name} data NULL in {label}",
                    Status.NULL_POINTER,
                    names(name),
                    arrays(**{name: None}, mode=label),
                    attrs(null_data=(name,), mode=mode),
                    stage="compute",
                ),
                Case(
                    f"{name}_desc NULL, attributes {label}",
                    Status.NULL_POINTER,
                    names(name),
                    None,
                    lambda p, n=name, m=mode: (descs(**{n: None})(p), attrs(mode=m)(p)),
                    stage="attributes",
                ),
            ]
    return cases


CASES: list[Case] = [
    *_data_shape_cases(),
    Case(
        "grad_output shape",
        Status.BAD_TENSOR_SHAPE,
        names("grad_output"),
        arrays(grad_output=np.ones((N, C, L + 1), np.float32)),
        descs(grad_output=(F32, (N, C, L + 1), None)),
    ),
    Case(
        "grad_input shape",
        Status.BAD_TENSOR_SHAPE,
        names("grad_input"),
        None,
        descs(grad_input=(F32, (N, C + 1, L), None)),
    ),
    *_per_channel_cases(),
    Case(
        "int32 input",
        Status.BAD_TENSOR_DTYPE,
        names("input"),
        arrays(input=np.ones(SHAPE, np.int32), grad_output=np.ones(SHAPE, np.int32)),
        descs(**{n: (I32, SHAPE, None) for n in DATA}),
    ),
    Case(
        "F16 grad_output with F32 input",
        Status.BAD_TENSOR_DTYPE,
        names("grad_output"),
        arrays(grad_output=lambda a: a["grad_output"].astype(np.float16)),
        descs(grad_output=(F16, SHAPE, None)),
    ),
    Case(
        "F16 grad_input with F32 input",
        Status.BAD_TENSOR_DTYPE,
        names("grad_input"),
        None,
        descs(grad_input=(F16, SHAPE, None)),
    ),
    Case(
        "F16 input with F32 grad_output",
        Status.BAD_TENSOR_DTYPE,
        names("grad_output"),
        arrays(
            input=lambda a: a["input"].astype(np.float16),
            weight=lambda a: a["weight"].astype(np.float16),
        ),
        descs(input=(F16, SHAPE, None), grad_input=(F16, SHAPE, None), weight=(F16, (C,), None)),
    ),
    Case(
        "grad_input overlapping strides",
        Status.BAD_TENSOR_STRIDES,
        names("grad_input"),
        None,
        descs(grad_input=(F32, SHAPE, (0, 1, 1))),
    ),
    Case(
        "grad_input broadcast channel",
        Status.BAD_TENSOR_STRIDES,
        names("grad_input"),
        None,
        descs(grad_input=(F32, SHAPE, (L, 0, 1))),
    ),
    *(
        Case(
            f"{name} negative strides",
            Status.BAD_TENSOR_STRIDES,
            names(name),
            None if name == "grad_input" else arrays(**{name: lambda a, n=name: a[n][..., ::-1]}),
            descs(**{name: (F32, SHAPE, (C * L, L, -1))}),
        )
        for name in DATA
    ),
    *(
        Case(
            f"eps {eps}",
            Status.BAD_PARAM,
            names("eps"),
            arrays(eps=eps),
            attrs(eps=eps),
            stage="attributes",
        )
        for eps in (-1e-5, math.nan, math.inf, -math.inf, "abc")
    ),
    Case("array eps None", Status.BAD_PARAM, names("eps"), arrays(eps=None)),
    Case(
        "unknown mode",
        Status.BAD_PARAM,
        names("mode"),
        arrays(mode="bogus"),
        attrs(mode=7),
        stage="attributes",
    ),
    Case(
        "negative mode",
        Status.BAD_PARAM,
        names("mode"),
        arrays(mode=-1),
        attrs(mode=-1),
        stage="attributes",
    ),
    *_null_cases(),
    Case("desc_ptr NULL", Status.NULL_POINTER, names("desc_ptr"), None, attrs(null_out="desc_ptr")),
    Case(
        "workspace size_ptr NULL",
        Status.NULL_POINTER,
        names("size"),
        None,
        attrs(null_out="size"),
        stage="workspace",
    ),
    Case(
        "device CAMBRICON",
        Status.DEVICE_TYPE_NOT_SUPPORTED,
        "CAMBRICON",
        None,
        attrs(device=(Device.CAMBRICON, 0)),
        stage="infinirtSetDevice",
    ),
    Case(
        "device 99",
        Status.DEVICE_TYPE_NOT_SUPPORTED,
        "99",
        None,
        attrs(device=(99, 0)),
        stage="infinirtSetDevice",
    ),
    Case(
        "CPU device 1",
        Status.DEVICE_NOT_FOUND,
        "device_id",
        None,
        attrs(device=(Device.CPU, 1)),
        stage="infinirtSetDevice",
    ),
    Case("handle 12345", Status.BAD_PARAM, names("handle"), None, attrs(handle=12345)),
    Case("handle NULL", Status.NULL_POINTER, names("handle"), None, attrs(handle=0)),
    Case(
        "destroyed input_desc",
        Status.BAD_PARAM,
        names("input"),
        None,
        attrs(destroyed_tensor="input"),
    ),
    Case(
        "descriptor used after destroy",
        Status.BAD_PARAM,
        names("desc"),
        None,
        attrs(destroy_first=True),
        stage="compute",
    ),
    Case(
        "descriptor destroyed twice",
        Status.BAD_PARAM,
        names("desc"),
        None,
        attrs(destroy_twice=True),
        stage="destroy",
    ),
    Case(
        "grad_output on another device",
        Status.BAD_PARAM,
        "grad_output on NVIDIA",
        arrays(grad_output=OnCuda(SHAPE)),
    ),
    Case(
        "weight of another kind and device",
        Status.BAD_PARAM,
        "weight on NVIDIA",
        arrays(weight=OnCuda((C,))),
    ),
    Case(
        "torch meta tensor",
        Status.DEVICE_TYPE_NOT_SUPPORTED,
        names("grad_output"),
        arrays(grad_output=torch.empty(SHAPE, device="meta")),
    ),
    Case(
        "saved_mean without saved_invstd",
        Status.NULL_POINTER,
        names("saved_invstd"),
        saved_statistics(saved_mean=lambda a: a["running_mean"]),
    ),
    Case(
        "saved_invstd without saved_mean",
        Status.NULL_POINTER,
        names("saved_mean"),
        saved_statistics(saved_invstd=lambda a: a["running_var"]),
    ),
    *(
        Case(
            f"saved_* with mode {mode}",
            Status.BAD_PARAM,
            "saved_mean.*mode",
            saved_statistics(
                mode=mode,
                saved_mean=lambda a: a["weight"],
                saved_invstd=lambda a: a["weight"],
            ),
        )
        for mode in ("train", "eval")
    ),
    Case(
        "running_* and saved_* together",
        Status.BAD_PARAM,
        "running_mean.*saved_mean",
        arrays(
            mode="saved",
            saved_mean=lambda a: a["running_mean"],
            saved_invstd=lambda a: a["running_var"],
        ),
    ),
    Case(
        "saved_mean of wrong shape",
        Status.BAD_TENSOR_SHAPE,
        "(saved|running)_mean",
        saved_statistics(
            saved_mean=np.ones(C + 1, np.float32),
            saved_invstd=np.ones(C, np.float32),
        ),
    ),
    Case(
        "input is a list",
        Status.BAD_PARAM,
        names("input"),
        arrays(input=lambda a: a["input"].tolist()),
    ),
    Case("weight is a list", Status.BAD_PARAM, names("weight"), arrays(weight=[1.0] * C)),
]
ARRAY_CASES = [case for case in CASES if case.array]
CAPI_CASES = [case for case in CASES if case.capi]


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))


def _snapshot(args: dict) -> dict:
    """Copies of the arguments' values (a torch meta tensor has none)."""
    return {
        k: np.array(v, copy=True)
        for k, v in args.items()
        if isinstance(v, np.ndarray) or (isinstance(v, torch.Tensor) and not v.is_meta)
    }


@pytest.mark.parametrize("case", ARRAY_CASES, ids=[c.id for c in ARRAY_CASES])
def test_array_api(case: Case):
    args = array_args()
    case.array(args)
    before, cached = _snapshot(args), len(cudnn_bn.descriptor_cache)
    with pytest.raises(InfiniError) as caught:
        call_array(args)
    assert caught.value.status == case.status, str(caught.value)
    assert type(caught.value.status) is Status
    assert re.search(case.pattern, str(caught.value)), str(caught.value)
    for name, value in before.items():  # nothing written, nothing cached
        assert np.array_equal(np.asarray(args[name]), value), name
    assert len(cudnn_bn.descriptor_cache) == cached


@pytest.mark.parametrize("case", CAPI_CASES, ids=[c.id for c in CAPI_CASES])
def test_capi(case: Case):
    problem = CapiProblem()
    case.capi(problem)
    outcome, buffers = run_capi(problem)
    assert (outcome.stage, outcome.status) == (case.stage, case.status), outcome.message
    assert re.search(case.pattern, outcome.message), outcome.message
    if case.stage != "destroy":  # a second destroy fails after a good compute
        for name in OUTPUTS:
            assert buffers[name].untouched(), f"{name} was written"


# --- inputs that look odd but are good ----------------------------------------------------


def test_nvidia_device_without_gpu():
    if gpu_present():
        pytest.skip("a GPU is present, so the NVIDIA device can be set")
    outcome, buffers = run_capi(CapiProblem(device=(Device.NVIDIA, 0)))
    assert (outcome.stage, outcome.status) == ("infinirtSetDevice", Status.DEVICE_NOT_INITIALIZED)
    assert re.search("cuda|CuPy|NVIDIA", outcome.message), outcome.message
    assert all(buffers[name].untouched() for name in OUTPUTS)


def test_failed_set_device_keeps_the_current_device():
    assert capi.infinirtSetDevice(Device.CAMBRICON, 0) == Status.DEVICE_TYPE_NOT_SUPPORTED
    outcome, _ = run_capi(CapiProblem())
    assert outcome.status == Status.SUCCESS, outcome.message


@pytest.mark.parametrize("eps", [0, 0.0, 1e-5, 1])
def test_eps_zero_and_other_finite_values_are_accepted(eps):
    args = array_args()
    args["eps"] = eps
    grad_input, grad_weight, grad_bias = call_array(args)
    assert all(np.isfinite(g).all() for g in (grad_input, grad_weight, grad_bias))
    outcome, buffers = run_capi(CapiProblem(eps=eps))
    assert outcome.status == Status.SUCCESS, outcome.message
    assert not buffers["grad_input"].untouched()


def _backward_eps(x, big):
    return cudnn_bn.batch_norm_backward(x, x, None, None, None, eps=big)


def _training_momentum(x, big):
    return cudnn_bn.batch_norm_forward_training(x, None, None, None, None, momentum=big)


@pytest.mark.parametrize(
    "entry, name",
    [
        (_backward_eps, "eps"),
        (_training_momentum, "momentum"),
        (lambda x, big: BatchNorm(3, eps=-big), "eps"),
    ],
)
def test_a_number_beyond_any_double_is_a_bad_param_naming_it(entry, name):
    """eps or momentum an int too large for a double (10**400) is BAD_PARAM naming it; it
    was INTERNAL_ERROR "unexpected OverflowError ... int too large to convert to float"
    (found by an outsider's attack)."""
    message = (
        rf"^BAD_PARAM: {name} is -?10+\.\.\. \(40[12] characters\), outside the range of double$"
    )
    with pytest.raises(InfiniError, match=message) as info:
        entry(np.ones((2, 3), np.float32), 10**400)
    assert info.value.status == Status.BAD_PARAM


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_running_statistics_may_be_missing_only_in_train(mode):
    """NULL running data: fine in train (not read), NULL_POINTER in saved and eval."""
    outcome, _ = run_capi(CapiProblem(mode=mode, null_data=("running_mean", "running_var")))
    assert outcome.status == (Status.SUCCESS if mode == 0 else Status.NULL_POINTER)
    outcome, _ = run_capi(
        CapiProblem(
            mode=mode,
            descs={
                **CapiProblem().descs,
                "running_mean": None,
                "running_var": None,
            },
        )
    )
    assert outcome.status == (Status.SUCCESS if mode == 0 else Status.NULL_POINTER)
    args = array_args()
    args.update(mode=("train", "saved", "eval")[mode], running_mean=None, running_var=None)
    if mode == 0:
        call_array(args)
    else:
        with pytest.raises(InfiniError) as caught:
            call_array(args)
        assert caught.value.status == Status.NULL_POINTER


@pytest.mark.parametrize(
    ("data", "channel"),
    [
        (F16, F16),
        (F16, F32),
        (F32, F32),
        (F64, F64),
        (BF16, BF16),
        (BF16, F32),
    ],
)
def test_allowed_dtype_pairs(data, channel):
    """Per-channel tensors in the data dtype, or F32 for F16/BF16 data (the C API)."""
    problem = CapiProblem(
        descs={
            **{n: (data, SHAPE, None) for n in DATA},
            **{n: (channel, (C,), None) for n in PER_CHANNEL},
        }
    )
    outcome, _ = run_capi(problem)
    assert outcome.status == Status.SUCCESS, outcome.message


@pytest.mark.parametrize(
    ("data", "channel"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_allowed_dtype_pairs_array_api(data, channel):
    x, dy = torch.randn(SHAPE, dtype=data), torch.randn(SHAPE, dtype=data)
    w = torch.ones(C, dtype=channel)
    grad_input, grad_weight, grad_bias = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    assert grad_input.dtype == data
    assert grad_weight.dtype == grad_bias.dtype == channel


def test_bf16_weight_with_f16_input_is_a_dtype_error():
    x, dy = torch.randn(SHAPE, dtype=torch.float16), torch.randn(SHAPE, dtype=torch.float16)
    with pytest.raises(InfiniError) as caught:
        cudnn_bn.batch_norm_backward(x, dy, torch.ones(C, dtype=torch.bfloat16), None, None)
    assert caught.value.status == Status.BAD_TENSOR_DTYPE
    assert re.search(names("weight"), str(caught.value))


# --- the workspace check -------------------------------------------------------------------


def test_insufficient_workspace(monkeypatch):
    """The CPU backend needs no workspace; pretend it needs 64 bytes to reach the check."""
    monkeypatch.setattr(cpu.BatchNormBackward, "workspace_size", 64)
    args = {k: np.asarray(v) for k, v in array_args().items() if k in POSITIONAL}
    outputs = {
        "grad_input": np.full(SHAPE, 7.0, np.float32),
        "grad_weight": np.full(C, 7.0, np.float32),
        "grad_bias": np.full(C, 7.0, np.float32),
    }
    arrays_in_order = [outputs.get(name, args.get(name)) for name in BACKWARD_ORDER]
    pointers = [a.ctypes.data for a in arrays_in_order]
    handle, op, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
    assert capi.infiniopCreateHandle(ctypes.byref(handle)) == 0
    tensors = []
    for a in arrays_in_order:
        tensors.append(ctypes.c_void_p())
        assert (
            capi.infiniopCreateTensorDescriptor(
                ctypes.byref(tensors[-1]), a.ndim, list(a.shape), None, F32
            )
            == 0
        )
    try:
        assert (
            capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(op), *tensors) == 0
        )
        assert capi.infiniopGetBatchNormBackwardWorkspaceSize(op, ctypes.byref(size)) == 0
        assert size.value == 64
        workspace = np.zeros(64, np.uint8)
        for given, needed_status, pattern in (
            (63, Status.INSUFFICIENT_WORKSPACE, "workspace_size"),
            (0, Status.INSUFFICIENT_WORKSPACE, "workspace_size"),
        ):
            status = capi.infiniopBatchNormBackward(
                op, workspace.ctypes.data, given, *pointers, None
            )
            assert status == needed_status and re.search(pattern, capi.last_error())
        status = capi.infiniopBatchNormBackward(op, None, 64, *pointers, None)
        assert status == Status.NULL_POINTER and "workspace" in capi.last_error()
        assert all((out == 7.0).all() for out in outputs.values()), "an output was written"
        status = capi.infiniopBatchNormBackward(op, workspace.ctypes.data, 64, *pointers, None)
        assert status == Status.SUCCESS, capi.last_error()
        assert not (outputs["grad_input"] == 7.0).all()
    finally:
        capi.infiniopDestroyBatchNormBackwardDescriptor(op)
        for desc in tensors:
            capi.infiniopDestroyTensorDescriptor(desc)
        capi.infiniopDestroyHandle(handle)


def test_python_descriptor_after_destroy_raises():
    """The descriptor object itself: use after destroy and a second destroy raise BAD_PARAM."""
    args = array_args()
    cudnn_bn.descriptor_cache.clear()
    call_array(args)
    (cached,) = cudnn_bn.descriptor_cache.descriptors()  # a plan's: it refuses destroy()
    desc = type(cached)(cached.handle, *cached.tensors[:8])
    assert desc.workspace_size == 0
    desc.destroy()
    for use in (
        desc.destroy,
        lambda: desc.workspace_size,
        lambda: desc.set_attributes(1e-5, 0),
        lambda: desc.compute(0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
    ):
        with pytest.raises(InfiniError) as caught:
            use()
        assert caught.value.status == Status.BAD_PARAM
    cudnn_bn.descriptor_cache.clear()  # closing a destroyed descriptor is quiet


class _Address:
    """An object that is an int only through ``__index__`` (as NumPy's integers are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def _compute_with(kind, workspace=0, size=0) -> None:
    """The cached backward's compute on gradients and inputs whose addresses are given as
    ``kind`` integers (with ``workspace`` and its ``size``): the array API's results."""
    args = array_args()
    cudnn_bn.descriptor_cache.clear()
    want = call_array(args)
    (cached,) = cudnn_bn.descriptor_cache.descriptors()
    grads = [np.zeros(SHAPE, np.float32), *(np.zeros(C, np.float32) for _ in range(2))]
    inputs = [args[n] for n in ("input", "grad_output", "weight")]
    values = [kind(a.ctypes.data) for a in grads + inputs]
    with type(cached)(cached.handle, *cached.tensors[:8]) as op:
        op.compute(workspace, size, *values, 0, 0)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kind", [_Address, np.uint64, np.int64])
def test_a_compute_takes_an_integer_of_any_kind_as_its_int(kind):
    """An address given as any integer (``__index__``) is its int: the compute runs as with
    Python's (an ``__index__`` object passed struct's check unconverted and escaped as a
    TypeError from the CPU engine's range check)."""
    _compute_with(kind)


@pytest.mark.parametrize("kind, size", [(np.uint64, 2**64 - 1), (np.int64, 2**63 - 1)])
def test_a_compute_given_numpy_integers_near_their_range_warns_nothing(kind, size):
    """NumPy integers whose sum overflows their type (a workspace size near its range) are
    checked without NumPy's overflow warning, which under ``-W error`` escaped compute as a
    RuntimeWarning (found by an outsider's attack)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compute_with(kind, kind(0), kind(size))


class _Lying(numbers.Real):
    """A real number whose ``__float__`` and ``__index__`` return other types: Python's own
    conversion then raises a TypeError, which escaped as INTERNAL_ERROR."""

    __float__ = __index__ = lambda self: "1"
    locals().update(dict.fromkeys(numbers.Real.__abstractmethods__ - {"__float__"}, None))


class _Stream:
    """A stream object whose address is such a number."""

    ptr = _Lying()


@pytest.mark.parametrize(
    "call",
    [
        lambda x: cudnn_bn.batch_norm_forward_training(x, None, None, None, None, eps=_Lying()),
        lambda x: cudnn_bn.batch_norm_forward_inference(x, None, None, x[0], x[0], eps=_Lying()),
        lambda x: cudnn_bn.batch_norm_backward(x, x, None, None, None, stream=_Stream()),
        lambda x: BatchNorm(C, momentum=_Lying()),
    ],
    ids=["eps", "inference eps", "stream", "layer momentum"],
)
def test_a_scalar_whose_conversion_returns_another_type_is_bad_param(call):
    x = np.ones((N, C), np.float32)
    with pytest.raises(InfiniError, match=r"(eps|stream|momentum) is .*returned non-") as caught:
        call(x)
    assert caught.value.status == Status.BAD_PARAM


def test_a_compute_address_whose_index_returns_another_type_is_bad_param():
    args = array_args()
    call_array(args)
    (cached,) = cudnn_bn.descriptor_cache.descriptors()
    with type(cached)(cached.handle, *cached.tensors[:8]) as op, pytest.raises(InfiniError) as c:
        op.compute(_Lying(), 0, *[0] * 8, 0)
    assert c.value.status == Status.BAD_PARAM and "workspace is" in str(c.value)


def test_a_scalar_conversion_the_caller_raises_passes_through():
    class Mine(TypeError):
        pass

    class Raising(_Lying):
        def __float__(self):
            raise Mine

    with pytest.raises(Mine):
        cudnn_bn.batch_norm_forward_training(
            np.ones((N, C), np.float32), None, None, None, None, eps=Raising()
        )


_ADDRESS_SCRIPT = """
import numpy as np
from cudnn_bn import DataType, Device, Handle, InfiniError
from cudnn_bn.ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from cudnn_bn.tensor import TensorDesc

x, w, y = np.ones((8, 4), np.float32), np.ones(4, np.float32), np.full((8, 4), 7.0, np.float32)
data, channel = (TensorDesc(DataType.F32, s, t) for s, t in (((8, 4), (4, 1)), ((4,), (1,))))
op = BatchNormForwardInferenceDescriptor(Handle(Device.CPU, 0), data, data, *[channel] * 4)
try:
    op.compute(0, 0, y.ctypes.data, {bad}, *[w.ctypes.data] * 4)
except InfiniError as exc:
    print(int(exc.status), str(exc).splitlines()[0], (y == 7.0).all())
"""


@pytest.mark.parametrize(
    "bad", ["'7'", "1.5", "True", "-5", "1 << 64", "(1 << 63) + 8", "np.float32(2.0)"]
)
def test_a_compute_refuses_what_is_not_an_address(bad):
    """A descriptor's ``compute`` takes addresses as ints (0 to 2**64 - 1); anything else is
    BAD_PARAM naming the argument, the output untouched. (Its kernel's entry point would
    convert a string or a float, numba's dispatcher failed on them with a TypeError or an
    LLVM error, and True, -5 or an address beyond 2**63 - 1 crashed the process; run in a
    child process for that reason.)"""
    script = _ADDRESS_SCRIPT.format(bad=bad)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    status, *message, untouched = done.stdout.split()
    assert int(status) == Status.BAD_PARAM and "input" in message[1], done.stdout
    assert untouched == "True"


NOT_WORDS = st.one_of(
    st.text(max_size=3),
    st.floats(),
    st.just(True),  # False is 0 to Python, and to a compute: NULL
    st.integers(max_value=-1),
    st.integers(min_value=1 << 64, max_value=1 << 70),
    st.builds(np.float64, st.floats(0, 1e6)),
    st.builds(np.bool_, st.booleans()),
    st.just(b"\x00"),
)


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, 10), value=NOT_WORDS)
def test_a_compute_refuses_each_argument_that_is_not_an_int_in_any_position(position, value):
    """Any argument of a backward ``compute`` (an address, a size or the stream) that is not
    an int from 0 to 2**64 - 1 (nor None, which is 0): BAD_PARAM naming that argument,
    nothing written."""
    args = array_args()
    cudnn_bn.descriptor_cache.clear()
    call_array(args)
    (cached,) = cudnn_bn.descriptor_cache.descriptors()
    grads = [np.full(SHAPE, 7.0, np.float32), *(np.full(C, 7.0, np.float32) for _ in range(2))]
    inputs = [args[n] for n in ("input", "grad_output", "weight")]
    values = [0, 0, *(a.ctypes.data for a in grads + inputs), 0, 0, 0]  # ..., stream
    values[position] = value
    with type(cached)(cached.handle, *cached.tensors[:8]) as op, pytest.raises(InfiniError) as e:
        op.compute(*values)
    name = ("workspace", "workspace_size", *BACKWARD_ORDER[:8], "stream")[position]
    assert e.value.status == Status.BAD_PARAM, e.value
    assert re.search(names(name), str(e.value)), (name, str(e.value))
    assert all((g == 7.0).all() for g in grads), "an output was written"


@pytest.mark.parametrize(
    "entry",
    [
        "batch_norm_forward_training",
        "batch_norm_forward_inference",
        "batch_norm_backward",
        "batch_norm_backward_batched",
    ],
)
def test_arguments_that_do_not_bind_raise_pythons_type_error(entry):
    """A misspelled keyword or a missing argument is the call's own mistake, refused by Python
    before the package runs (as by any function): a ``TypeError`` naming it, alike on every
    entry point, never an INTERNAL_ERROR blaming the package."""
    function = getattr(cudnn_bn, entry)
    with pytest.raises(TypeError, match="unexpected keyword argument 'epss'") as caught:
        function(np.ones((2, 3, 4)), np.ones((2, 3, 4)), None, None, None, epss=1e-5)
    assert not isinstance(caught.value, InfiniError)
    with pytest.raises(TypeError, match="missing") as caught:
        function(np.ones((2, 3, 4)))
    assert not isinstance(caught.value, InfiniError)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_refused_dtype_names_only_its_argument(lib):
    """The door's dtype refusal said "(a reserve: also uint8 or int8)", which the training
    forward respells as "(a out[3]: ...)" for a running_mean: it names no argument now."""
    x, w = np.ones((4, 3), np.float32), np.ones(3, np.float32)
    bad = np.ones(3, np.int32) if lib == "numpy" else torch.ones(3, dtype=torch.int32)
    with pytest.raises(InfiniError) as info:
        cudnn_bn.batch_norm_forward_training(x, w, w, bad, w.copy())
    assert info.value.status == Status.BAD_TENSOR_DTYPE
    message = str(info.value)
    assert "running_mean" in message and "out[" not in message and "reserve" not in message


def test_a_grad_z_out_without_its_fusion_is_named_once():
    """``out[3]`` given to a backward that is not ``fusion="add_relu"`` said "out[3] (out[3])
    is given": the operator's message named it twice, once as ``grad_z``, which the array
    API respells as ``out[3]``."""
    x = np.ones((4, 3, 5))
    grad_z = np.full_like(x, 7.0)
    with pytest.raises(InfiniError) as info:
        cudnn_bn.batch_norm_backward(x, x, None, None, None, out=(None, None, None, grad_z))
    assert info.value.status == Status.BAD_PARAM
    message = str(info.value)
    assert message.count("out[3]") == 1 and "fusion='add_relu'" in message, message
    assert (grad_z == 7.0).all()
