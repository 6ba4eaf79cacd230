"""``output_mask`` of batch-norm backward on the CPU, all eight masks in every mode.

Masked-off gradients come back as None from the array API; through
``BatchNormBackwardDescriptor.compute`` they may be NULL, and a buffer given for one is left
exactly as it was. The gradients asked for equal those of the full computation bit for bit
and PyTorch's (``helpers.reference``, float64) within F32's 2e-5, InfiniCore's tolerance.
"""

import itertools

import numpy as np
import pytest
from helpers import assert_close, random_values, reference

import cudnn_bn
from cudnn_bn import DataType, Device, Handle, InfiniError, Status, TensorDesc

MASKS = list(itertools.product([False, True], repeat=3))
MODES = ["train", "saved", "eval"]
SENTINEL = -12345.0
SHAPE = (4, 3, 5)


def problem(seed=0) -> dict[str, np.ndarray]:
    return {name: v.astype(np.float32) for name, v in random_values(SHAPE, seed).items()}


def inputs(p: dict) -> tuple:
    return p["input"], p["grad_output"], p["weight"], p["running_mean"], p["running_var"]


def expected(p: dict, mode: str):
    return reference(
        p["input"], p["grad_output"], p["weight"], mode=mode,
        mean=p["running_mean"], var=p["running_var"],
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_array_api(mask, mode):
    p = problem()
    full = cudnn_bn.batch_norm_backward(*inputs(p), mode=mode)
    got = cudnn_bn.batch_norm_backward(*inputs(p), mode=mode, output_mask=mask)
    assert len(got) == 3
    for wanted, result, whole, want in zip(mask, got, full, expected(p, mode), strict=True):
        if not wanted:
            assert result is None
            continue
        np.testing.assert_array_equal(result, whole)
        assert_close(result, want, np.float32)


def descriptor_for(p: dict, mode: str, mask) -> cudnn_bn.BatchNormBackwardDescriptor:
    """A CPU descriptor for ``p``'s contiguous F32 arrays (outputs shaped like their inputs)."""
    desc = {n: TensorDesc.contiguous(DataType.F32, a.shape) for n, a in p.items()}
    return cudnn_bn.BatchNormBackwardDescriptor(
        Handle(Device.CPU, 0),
        desc["input"],
        desc["weight"],
        desc["weight"],
        *(desc[n] for n in ("input", "grad_output", "weight", "running_mean", "running_var")),
        mode=mode,
        output_mask=mask,
    )


@pytest.mark.parametrize("masked_off", ["null", "sentinel"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_descriptor_compute(mask, mode, masked_off):
    """Masked-off outputs may be NULL pointers; a buffer given for one is not written."""
    p = problem()
    outputs = {
        "grad_input": np.full(SHAPE, SENTINEL, np.float32),
        "grad_weight": np.full(SHAPE[1], SENTINEL, np.float32),
        "grad_bias": np.full(SHAPE[1], SENTINEL, np.float32),
    }
    pointers = {
        n: a.ctypes.data if wanted or masked_off == "sentinel" else 0
        for (n, a), wanted in zip(outputs.items(), mask, strict=True)
    }
    with descriptor_for(p, mode, mask) as descriptor:
        assert descriptor.workspace_size == 0
        descriptor.compute(0, 0, *pointers.values(), *(a.ctypes.data for a in inputs(p)))
    for wanted, (name, array), want in zip(mask, outputs.items(), expected(p, mode), strict=True):
        if wanted:
            assert_close(array, want, np.float32)
        else:
            assert (array == SENTINEL).all(), f"{name} was written"


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_add_relu_always_gives_grad_z(mask):
    """The mask covers the three batch-norm gradients; the residual's is always computed."""
    p = problem()
    output = np.maximum(p["input"], 0)  # any forward output: only its sign is read
    got = cudnn_bn.batch_norm_backward(
        *inputs(p), fusion="add_relu", output=output, bias=p["weight"], output_mask=mask
    )
    full = cudnn_bn.batch_norm_backward(
        *inputs(p), fusion="add_relu", output=output, bias=p["weight"]
    )
    assert len(got) == 4
    np.testing.assert_array_equal(got[3], np.where(output > 0, p["grad_output"], 0))
    for wanted, result, whole in zip(mask, got[:3], full[:3], strict=True):
        assert result is None if not wanted else np.array_equal(result, whole)


BAD_MASKS = [
    (True, True),
    (True, True, True, True),
    (1, 1, 1),
    (True, False, None),
    "TTT",
    None,
    True,
]


@pytest.mark.parametrize("mask", BAD_MASKS, ids=repr)
def test_bad_mask_is_bad_param(mask):
    p = problem()
    with pytest.raises(InfiniError) as error:
        cudnn_bn.batch_norm_backward(*inputs(p), output_mask=mask)
    assert error.value.status == Status.BAD_PARAM
    assert "output_mask" in str(error.value)
    assert "out[" not in str(error.value)  # the gradients are no out= entries here
    with pytest.raises(InfiniError) as error:
        descriptor_for(p, "train", mask)
    assert error.value.status == Status.BAD_PARAM
    with descriptor_for(p, "train", (True, True, True)) as descriptor:
        with pytest.raises(InfiniError) as error:
            descriptor.set_attributes(1e-5, "train", output_mask=mask)
        assert error.value.status == Status.BAD_PARAM
        assert descriptor.attributes.output_mask == (True, True, True)  # unchanged


def test_values_equal_to_valid_ones_do_not_hit_the_descriptor_cache():
    """(1, 1, 1) == (True, True, True) and 1 == True in Python: both are still BAD_PARAM
    after the valid call has cached its descriptor."""
    p = problem()
    cudnn_bn.batch_norm_backward(*inputs(p), output_mask=(True, True, True), persistent=True)
    for bad in (dict(output_mask=(1, 1, 1)), dict(persistent=1)):
        with pytest.raises(InfiniError) as error:
            cudnn_bn.batch_norm_backward(*inputs(p), **{"persistent": True, **bad})
        assert error.value.status == Status.BAD_PARAM
