"""``cudnn_bn.folding.fold_conv_bn`` (NumPy) against PyTorch: one convolution with the folded
weight and bias equals the convolution followed by evaluation-mode ``F.batch_norm``.

Both sides run in float64 on the same (rounded) parameters, so the only difference is the
folded parameters' rounding to their dtype: within 2e-5 for F32 and 1e-2 for F16, InfiniCore's
tolerances (``helpers.TOL``; an F16 ulp is 1e-3 relative, summed over a small kernel).
"""

import gc
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, f64

from cudnn_bn import InfiniError, Status
from cudnn_bn.folding import fold_conv_bn

EPS = 1e-5
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
BN = ("bn_weight", "bn_bias", "running_mean", "running_var")


def parameters(weight_shape, channels, dtype=np.float32, seed=0) -> dict[str, np.ndarray]:
    """Convolution weight and bias, batch-norm parameters and running statistics."""
    rng = np.random.default_rng(seed)
    values = {
        "conv_weight": rng.standard_normal(weight_shape) * 0.5,
        "conv_bias": rng.standard_normal(channels) * 0.5,
        "bn_weight": rng.uniform(0.5, 1.5, channels),
        "bn_bias": rng.standard_normal(channels) * 0.5,
        "running_mean": rng.standard_normal(channels) * 0.3,
        "running_var": rng.uniform(0.5, 2.0, channels),
    }
    return {name: v.astype(dtype) for name, v in values.items()}


def image(*shape: int) -> torch.Tensor:
    """A reproducible float64 input of ``shape``."""
    return torch.from_numpy(np.random.default_rng(1).standard_normal(shape))


def optional(array):
    return None if array is None else f64(array)


def conv_then_bn(conv, x, p: dict, eps: float = EPS, **conv_args) -> torch.Tensor:
    """float64 ``bn(conv(x))`` with PyTorch, batch norm in evaluation mode."""
    y = conv(x, f64(p["conv_weight"]), optional(p["conv_bias"]), **conv_args)
    w, b, mean, var = (optional(p[n]) for n in BN)
    return F.batch_norm(y, mean, var, w, b, training=False, eps=eps)


def folded_conv(conv, x, p: dict, eps: float = EPS, transpose=False, **conv_args):
    weight, bias = fold_conv_bn(*p.values(), eps, transpose=transpose)
    assert type(weight) is np.ndarray and weight.dtype == p["conv_weight"].dtype
    assert weight.shape == p["conv_weight"].shape
    assert bias.dtype == weight.dtype and bias.shape == (p["running_mean"].shape[0],)
    return conv(x, f64(weight), f64(bias), **conv_args)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv(dims, groups):
    out_channels, in_channels, kernel = 4, 6, (3,) * dims
    p = parameters((out_channels, in_channels // groups, *kernel), out_channels)
    x = image(2, in_channels, *(5,) * dims)
    want = conv_then_bn(CONV[dims], x, p, groups=groups)
    assert_close(folded_conv(CONV[dims], x, p, groups=groups), want, np.float32)


@pytest.mark.parametrize("eps", [0.0, 1e-3, 0.5])
def test_eps(eps):
    p = parameters((4, 3, 3, 3), 4)
    x = image(2, 3, 6, 6)
    want = conv_then_bn(F.conv2d, x, p, eps)
    assert_close(folded_conv(F.conv2d, x, p, eps), want, np.float32)


def test_conv_transpose2d():
    """A transposed convolution's weight is (in, out, kH, kW): its output channels are axis 1."""
    in_channels, out_channels = 3, 5
    p = parameters((in_channels, out_channels, 3, 2), out_channels)
    x = image(2, in_channels, 4, 5)
    want = conv_then_bn(F.conv_transpose2d, x, p, stride=2)
    got = folded_conv(F.conv_transpose2d, x, p, transpose=True, stride=2)
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("missing", ["conv_bias", "bn_weight", "bn_bias", "all"])
def test_none_parameters(missing):
    """A missing conv bias or BN bias is zero, a missing BN weight is one."""
    p = parameters((4, 3, 3, 3), 4)
    for name in ("conv_bias", "bn_weight", "bn_bias") if missing == "all" else (missing,):
        p[name] = None
    x = image(2, 3, 6, 6)
    assert_close(folded_conv(F.conv2d, x, p), conv_then_bn(F.conv2d, x, p), np.float32)


@pytest.mark.parametrize("bn_dtype", [np.float16, np.float32])
def test_f16_weights(bn_dtype):
    """F16 convolution weights fold in float32 and come back as F16."""
    p = parameters((4, 3, 3, 3), 4, dtype=np.float16)
    p |= {n: p[n].astype(bn_dtype) for n in BN}
    x = image(2, 3, 6, 6)
    assert_close(folded_conv(F.conv2d, x, p), conv_then_bn(F.conv2d, x, p), np.float16)


def test_inputs_are_not_modified():
    p = parameters((4, 3, 3), 4)
    before = {n: a.copy() for n, a in p.items()}
    fold_conv_bn(*p.values(), EPS)
    for name, array in p.items():
        np.testing.assert_array_equal(array, before[name])


@pytest.mark.parametrize(
    ("weight_shape", "channels", "transpose", "wrong"),
    [
        ((4,), 4, False, None),  # a weight needs (out, in, *kernel)
        *(((4, 3, 3), 4, False, name) for name in ("conv_bias", *BN)),  # one of 3, not 4
        ((3, 4, 3), 3, True, None),  # sized for axis 0, but a transposed one's is axis 1
        ((4, 3, 3), 6, True, None),  # grouped transposed (2 groups): axis 1 is out / groups
    ],
)
def test_bad_shapes_are_bad_tensor_shape(weight_shape, channels, transpose, wrong):
    p = parameters(weight_shape, channels)
    if wrong is not None:
        p[wrong] = p[wrong][:-1]
    with pytest.raises(InfiniError) as error:
        fold_conv_bn(*p.values(), EPS, transpose=transpose)
    assert error.value.status == Status.BAD_TENSOR_SHAPE


@pytest.mark.parametrize("eps", [-1e-5, math.nan, math.inf, -math.inf, "small", None])
def test_bad_eps_is_bad_param(eps):
    p = parameters((4, 3, 3), 4)
    with pytest.raises(InfiniError) as error:
        fold_conv_bn(*p.values(), eps)
    assert error.value.status == Status.BAD_PARAM


def test_a_refused_fold_lets_its_arrays_go_without_the_garbage_collector():
    # Every decorated entry point re-raises through one helper that keeps no frame holding
    # its exception (a cycle that kept the caller's arrays until a collection; review 7).
    weight = np.ones((4, 3, 3, 3))
    kept = weakref.ref(weight)
    gc.disable()
    try:
        refused = ""
        try:
            fold_conv_bn(weight, None, np.ones(4), np.zeros(4), np.zeros(4), np.ones(4), -1.0)
        except InfiniError as exc:
            refused = str(exc)
        assert "eps" in refused
        del weight
        assert kept() is None
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "case", ["zero-variance-eps-0", "overflow-to-f32", "huge-scale", "f16-overflow"]
)
def test_values_torch_folds_to_inf_or_nan_fold_without_a_warning(case):
    """A variance of 0 with eps 0, a weight that overflows its dtype once scaled: torch's
    fold gives inf (or NaN) silently, and so does this one. NumPy warned (divide by zero,
    overflow), and under ``python -W error`` the warning escaped as INTERNAL_ERROR
    "unexpected RuntimeWarning" (found by an outsider's attack)."""
    dtype = np.float16 if case == "f16-overflow" else np.float32
    p = parameters((4, 3, 3, 3), 4, dtype)
    eps = EPS
    if case == "zero-variance-eps-0":
        p["running_var"][:], eps = 0, 0.0
    elif case == "overflow-to-f32":
        p["conv_weight"] *= np.float32(1e30)
        p["bn_weight"] *= np.float32(1e30)
    elif case == "huge-scale":
        p = {n: v.astype(np.float64) for n, v in p.items()}
        p["running_var"][:], p["bn_weight"][:], eps = 1e-300, 1e300, 0.0
    else:
        p["running_var"][:] = np.float16(6e-8)
        p["conv_weight"][:] = np.float16(60000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weight, bias = fold_conv_bn(*p.values(), eps)
    t = {n: torch.from_numpy(v) for n, v in p.items()}
    want_w, want_b = torch.nn.utils.fuse_conv_bn_weights(
        t["conv_weight"], t["conv_bias"], t["running_mean"], t["running_var"], eps,
        t["bn_weight"], t["bn_bias"],
    )  # fmt: skip
    np.testing.assert_array_equal(np.isfinite(weight), np.isfinite(want_w.detach().numpy()))
    np.testing.assert_array_equal(np.isnan(bias), np.isnan(want_b.detach().numpy()))
    assert not np.isfinite(weight).all()
