"""Fused batch norm on the CPU: ``y = relu(bn(x) [+ z])`` forward (fusion ``"relu"`` and
``"add_relu"``) and its backward, against PyTorch's composition of ``F.batch_norm`` (training)
and ``torch.relu`` in float64: the forward's value, and autograd's gradients (``grad_z``
included) for the backward, which takes the forward's ``output`` and ``bias``.

Tolerances are ``helpers.TOL``, InfiniCore's: 2e-5 for F32 against the exact float64
reference (rounding plus accumulation), 1e-2 for F16/BF16 (a few ulps of values near 1).
"""

import numpy as np
import pytest
import torch
from helpers import EPS, SHAPES, assert_close, f64, fused_problem, tolerance_dtype, torch_fused

from cudnn_bn import InfiniError, Status, batch_norm_backward, batch_norm_forward_training

DTYPES = [  # (data dtype, per-channel dtype)
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (np.float32, np.float32),
    (np.float64, np.float64),
]
FUSIONS = ["relu", "add_relu"]


def forward(p: dict, fusion: str):
    z = p["z"] if fusion == "add_relu" else None
    return batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], None, None, eps=EPS, fusion=fusion, z=z
    )


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_forward(data, channel, shape, fusion):
    p = fused_problem(shape, data, channel)
    output, _, _ = forward(p, fusion)
    want, _ = torch_fused(p, fusion)
    assert type(output) is type(p["input"]) and output.dtype == p["input"].dtype
    assert_close(output, want, tolerance_dtype(data))
    assert (f64(output) == 0).any() and (f64(output) > 0).any()  # the ReLU did cut


@pytest.mark.parametrize("mode", ["train", "saved"])
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_backward(data, channel, shape, fusion, mode):
    """Gradients through the ReLU mask of the forward's output, grad_z for add_relu."""
    p = fused_problem(shape, data, channel)
    out = forward(p, fusion)
    saved = dict(saved_mean=out[1], saved_invstd=out[2]) if mode == "saved" else {}
    grads = batch_norm_backward(
        p["input"], p["grad_output"], p["weight"], None, None,
        mode=mode, fusion=fusion, output=out[0], bias=p["bias"], reserve=out.reserve, **saved,
    )  # fmt: skip
    names = ("grad_input", "grad_weight", "grad_bias", "grad_z")[: 4 if fusion == "add_relu" else 3]
    assert len(grads) == len(names)
    _, want = torch_fused(p, fusion)
    for name, got in zip(names, grads, strict=True):
        assert type(got) is type(p["input"])
        assert_close(got, want[name], tolerance_dtype(data))


@pytest.mark.parametrize("fusion", FUSIONS)
def test_fused_backward_without_output_is_null_pointer(fusion):
    p = fused_problem((2, 3, 4), np.float32, np.float32)
    with pytest.raises(InfiniError) as error:
        batch_norm_backward(
            p["input"], p["grad_output"], p["weight"], None, None, fusion=fusion,
            output=None, bias=p["bias"],
        )  # fmt: skip
    assert error.value.status == Status.NULL_POINTER
    assert "output" in str(error.value)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_fused_backward_without_bias_is_a_zero_bias(fusion):
    """``bias=None`` is 0 in every pass (affine=False), the fused backward included."""
    p = fused_problem((2, 3, 4), np.float32, np.float32)
    zero = np.zeros_like(p["bias"])
    z = p.get("z") if fusion == "add_relu" else None
    out = batch_norm_forward_training(p["input"], p["weight"], None, None, None, fusion=fusion, z=z)
    args = (p["input"], p["grad_output"], p["weight"], None, None)
    grads = [
        batch_norm_backward(*args, fusion=fusion, output=out[0], bias=bias) for bias in (None, zero)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_array_equal(got, want)


def test_add_relu_forward_without_z_is_null_pointer():
    p = fused_problem((2, 3, 4), np.float32, np.float32)
    with pytest.raises(InfiniError) as error:
        batch_norm_forward_training(p["input"], p["weight"], p["bias"], None, None,
                                    fusion="add_relu")  # fmt: skip
    assert error.value.status == Status.NULL_POINTER
    assert "z" in str(error.value)


@pytest.mark.parametrize("fusion", ["gelu", "", 7, True])
def test_unknown_fusion_is_bad_param(fusion):
    p = fused_problem((2, 3, 4), np.float32, np.float32)
    with pytest.raises(InfiniError) as error:
        batch_norm_forward_training(p["input"], p["weight"], p["bias"], None, None, fusion=fusion)
    assert error.value.status == Status.BAD_PARAM
    with pytest.raises(InfiniError) as error:
        batch_norm_backward(p["input"], p["grad_output"], p["weight"], None, None, fusion=fusion)
    assert error.value.status == Status.BAD_PARAM
