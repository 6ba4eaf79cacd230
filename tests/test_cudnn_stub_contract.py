"""The stub libcudnn refuses what cuDNN documents as invalid (``cudnn_stub.py``'s rule table):
each rule breaks a call the package makes and gets cuDNN's status and the rule's name back,
and the rules in the C and in the table are the same set."""

import ctypes
import re

import cudnn_stub
import pytest
from cudnn_stub import (
    POINTERS,
    SPATIAL,
    STREAM,
    STUB_DEFINITIONS,
    STUB_RESERVE,
    WORKSPACE,
)
from helpers import BACKWARD_ORDER, channels_last
from test_nvidia_arguments import compute, descriptor

from cudnn_bn import Mode, Status
from cudnn_bn._cudnn.enums import CudnnDataType
from cudnn_bn._cudnn.tensor import TensorDescriptor
from cudnn_bn.backends import cudnn_engines, nvidia
from cudnn_bn.enums import DataType
from cudnn_bn.errors import InfiniError
from cudnn_bn.problems import BackwardPointers

F16, F32 = DataType.F16, DataType.F32
SHAPE = (2, 8, 3, 5)
ONE = ctypes.c_float(1.0)
RESERVE = {"reserve": POINTERS["reserve"], "reserve_size": STUB_RESERVE}


def test_every_rule_checked_is_in_the_table_and_back():
    checked = set(re.findall(r'"([a-z-]+)"\)', STUB_DEFINITIONS))
    table = set(re.findall(r"^([a-z-]+(?:, [a-z-]+)*): \d{4} ", cudnn_stub.__doc__, re.M))
    tabled = {rule for row in table for rule in row.split(", ")}
    assert checked == tabled


def persistent_backward(**attrs):
    """A channels-last F16 backward from saved statistics: SPATIAL_PERSISTENT with a reserve."""
    attrs = {"mode": "saved_invstd", **attrs}
    return descriptor(SHAPE, F16, F32, strides=channels_last(SHAPE), **attrs)


def refused(desc, rule: str, status: Status, **overrides) -> None:
    with pytest.raises(InfiniError, match=f"broke rule {rule}\\b") as caught:
        compute(desc, **overrides)
    assert caught.value.status == status


def test_reintroducing_finding_1_is_refused(stub, monkeypatch):
    """A train-mode backward in SPATIAL_PERSISTENT passes NULL saved statistics: BAD_PARAM."""

    def forward_mode(x, attributes):
        return cudnn_engines.bn_mode(x, True, attributes.persistent)

    monkeypatch.setattr(cudnn_engines, "backward_bn_mode", forward_mode)
    monkeypatch.setattr(nvidia, "backward_bn_mode", forward_mode)
    with persistent_backward(mode=Mode.TRAIN) as desc:
        refused(desc, "persistent-saved", Status.BAD_PARAM)
    assert stub.backward.calls == 0


def test_a_reserve_no_forward_filled_is_refused(stub):
    with persistent_backward() as desc:
        ptrs = (POINTERS[name] for name in BACKWARD_ORDER)
        with pytest.raises(InfiniError, match="broke rule reserve-from-forward"):
            desc.compute(WORKSPACE, desc.workspace_size, *ptrs, stream=STREAM, **RESERVE)
    assert stub.backward.calls == 0


# Template positions of cudnnBatchNormalizationBackwardEx's arguments, broken one at a time.
BROKEN_ARGUMENTS = {  # rule: (position, value, status)
    "bn-desc": (1, 0, Status.BAD_PARAM),  # PER_ACTIVATION with a SPATIAL descriptor
    "fused-operands": (2, 1, Status.BAD_PARAM),  # BN_ACTIVATION with no y, bias
    "alpha-beta": (4, ctypes.addressof(ONE), Status.BAD_PARAM),  # beta 1: a blend
    "epsilon": (22, -1.0, Status.BAD_PARAM),
    "workspace-size": (27, 1, Status.INSUFFICIENT_WORKSPACE),
}


@pytest.mark.parametrize("rule", BROKEN_ARGUMENTS)
def test_a_broken_argument_is_refused(stub, rule):
    position, value, status = BROKEN_ARGUMENTS[rule]
    with persistent_backward() as desc:
        desc._kernel._template[position] = value
        refused(desc, rule, status, **RESERVE)
    assert stub.backward.calls == 0


def test_a_small_reserve_is_refused(stub):
    with persistent_backward() as desc:
        desc._kernel.reserve_size = STUB_RESERVE - 2  # below what the query answered
        refused(desc, "reserve-size", Status.INSUFFICIENT_WORKSPACE, **RESERVE)


def test_a_misaligned_pointer_is_refused(stub):
    """By the descriptor's compute, before cuDNN (BAD_PARAM, as the C API documents); and by
    the stub, for a kernel handed one anyway."""
    with persistent_backward() as desc:
        with pytest.raises(InfiniError, match=r"input 0x[0-9a-f]+ is not aligned") as caught:
            compute(desc, input=POINTERS["input"] + 1)
        assert caught.value.status == Status.BAD_PARAM and stub.backward.calls == 0
        given = {**POINTERS, "input": POINTERS["input"] + 1}
        ptrs = BackwardPointers(*(given[name] for name in BACKWARD_ORDER))
        with pytest.raises(InfiniError, match=r"broke rule aligned\b") as caught:
            desc._kernel.run(ptrs, WORKSPACE, STREAM)
        assert caught.value.status == Status.BAD_TENSOR_STRIDES


def test_a_handle_off_its_device_is_refused(stub):
    with persistent_backward() as desc:
        stub.device.value = 1  # the device current now is not the handle's
        refused(desc, "handle-device", Status.INTERNAL_ERROR)


def test_a_call_without_its_stream_set_is_refused(stub, monkeypatch):
    with persistent_backward() as desc:
        desc._kernel._set_stream = lambda handle, stream: 0
        refused(desc, "stream-set", Status.BAD_PARAM)
    assert stub.backward.calls == 0


FUSED_BREAKS = {  # rule: (position, value, status)
    "fused-mode": (1, SPATIAL, Status.NOT_IMPLEMENTED),  # the fused kernels are persistent
    "fused-activation": (25, None, Status.BAD_PARAM),
}


@pytest.mark.parametrize("rule", FUSED_BREAKS)
def test_a_broken_fused_call_is_refused(stub, rule):
    position, value, status = FUSED_BREAKS[rule]
    fused = {"output": POINTERS["output"], "bias": POINTERS["bias"], **RESERVE}
    with persistent_backward(fusion="relu") as desc:
        desc._kernel._template[position] = value
        refused(desc, rule, status, **fused)
    assert stub.backward.calls == 0


TENSOR_BREAKS = {  # rule: (shape, strides, status)
    "tensor-dims": ((2, 0, 3, 4), (0, 12, 4, 1), Status.BAD_PARAM),
    "tensor-rank": ((65536, 65536), (65536, 1), Status.NOT_IMPLEMENTED),  # 2^32 elements
}


@pytest.mark.parametrize("rule", TENSOR_BREAKS)
def test_a_broken_tensor_descriptor_is_refused(stub, rule):
    shape, strides, status = TENSOR_BREAKS[rule]
    with pytest.raises(InfiniError, match=f"broke rule {rule}\\b") as caught:
        TensorDescriptor.nd(CudnnDataType.FLOAT, shape, strides)
    assert caught.value.status == status
