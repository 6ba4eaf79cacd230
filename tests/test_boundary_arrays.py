"""The array API, ``cupyx_compat`` and ``fold_conv_bn`` at their boundary (issue 9).

Arrays a call writes in place (running statistics, CuPy 13's ``mean``/``inv_std``) must be
writable and share no memory with each other or with an input the call reads; everything is
checked before anything is written; only ``InfiniError`` escapes (BAD_PARAM and shape errors
are also ``ValueError``, dtype errors ``TypeError``); messages name arguments as the
caller's API spells them; NumPy scalars stand where Python's do. Results where a call is
accepted are PyTorch's in float64.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import assert_close, random_values, reference, torch_training

import cudnn_bn
from cudnn_bn import InfiniError, Status
from cudnn_bn import cupyx_compat as cudnn
from cudnn_bn.errors import BadParamError

SHAPE = (4, 3, 5)


def training_problem(seed=0) -> dict:
    return random_values(SHAPE, seed, bias=True)


def _raises(status: Status, call, *words: str) -> InfiniError:
    with pytest.raises(InfiniError) as caught:
        call()
    assert caught.value.status == status, str(caught.value)
    for word in words:
        assert word in str(caught.value), str(caught.value)
    return caught.value


def _forward(p: dict, running_mean, running_var, **kwargs):
    return cudnn_bn.batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], running_mean, running_var, **kwargs
    )


# --- finding 3: read-only memory is never written -----------------------------------------


def _read_only(values: np.ndarray, how: str) -> np.ndarray:
    if how == "frombuffer":
        return np.frombuffer(values.tobytes(), values.dtype)
    array = values.copy()
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("how", ["writeable_false", "frombuffer"])
@pytest.mark.parametrize("which", ["running_mean", "running_var"])
def test_training_forward_refuses_read_only_running_statistics(which, how):
    p = training_problem()
    stats = {n: p[n].copy() for n in ("running_mean", "running_var")}
    stats[which] = _read_only(p[which], how)
    before = {n: s.copy() for n, s in stats.items()}
    _raises(Status.BAD_PARAM, lambda: _forward(p, **stats), which, "read-only")
    for name, value in stats.items():
        np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize("which", ["running_mean", "running_var", "mean", "inv_std"])
def test_cupyx_training_refuses_read_only_outputs(which):
    p = training_problem()
    x, gamma, beta = p["input"], p["weight"], p["bias"]
    arrays = {
        "running_mean": p["running_mean"].copy(),
        "running_var": p["running_var"].copy(),
        "mean": np.zeros(3),
        "inv_std": np.zeros(3),
    }
    arrays[which] = _read_only(arrays[which], "writeable_false")
    before = {n: a.copy() for n, a in arrays.items()}
    _raises(
        Status.BAD_PARAM,
        lambda: cudnn.batch_normalization_forward_training(
            x, gamma, beta, *arrays.values(), 1e-5, 0.9, True, cudnn.CUDNN_BATCHNORM_SPATIAL, False
        ),
        which,
    )
    for name, value in arrays.items():
        np.testing.assert_array_equal(value, before[name])


def test_read_only_memmap_running_mean_does_not_crash(tmp_path):
    """A read-only ``np.memmap`` is read-only pages: a write would kill the process, so the
    call runs in a child that must exit normally with BAD_PARAM."""
    path = tmp_path / "running_mean.bin"
    np.zeros(3).tofile(path)
    script = textwrap.dedent(
        f"""
        import numpy as np, cudnn_bn
        rm = np.memmap({str(path)!r}, dtype=np.float64, mode="r", shape=(3,))
        x = np.random.default_rng(0).standard_normal((4, 3, 5))
        try:
            cudnn_bn.batch_norm_forward_training(x, np.ones(3), np.zeros(3), rm, np.ones(3))
        except cudnn_bn.InfiniError as exc:
            print(exc.status.name)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "BAD_PARAM"


# --- finding 4: no half-writes in cupyx_compat -------------------------------------------


@pytest.mark.parametrize("bad", ["mean_shape", "inv_std_shape", "mean_on_other_kind"])
def test_cupyx_training_writes_nothing_when_an_output_is_wrong(bad):
    p = training_problem()
    rm, rv = p["running_mean"].copy(), p["running_var"].copy()
    mean, inv_std = np.zeros(3), np.zeros(3)
    if bad == "mean_shape":
        mean = np.zeros(4)
    elif bad == "inv_std_shape":
        inv_std = np.zeros((3, 2))  # any shape of 3 elements would do, as in CuPy 13
    else:
        mean = [0.0, 0.0, 0.0]
    before = (rm.copy(), rv.copy())
    with pytest.raises(InfiniError):
        cudnn.batch_normalization_forward_training(
            p["input"], p["weight"], p["bias"], rm, rv, mean, inv_std,
            1e-5, 0.9, True, cudnn.CUDNN_BATCHNORM_SPATIAL, False,
        )  # fmt: skip
    np.testing.assert_array_equal(rm, before[0])
    np.testing.assert_array_equal(rv, before[1])


# --- finding 7: aliasing ------------------------------------------------------------------


def test_running_mean_is_running_var_is_refused():
    p = training_problem()
    shared = p["running_var"].copy()
    error = _raises(
        Status.BAD_PARAM, lambda: _forward(p, shared, shared), "running_mean", "running_var"
    )
    assert isinstance(error, ValueError)
    np.testing.assert_array_equal(shared, p["running_var"])


@pytest.mark.parametrize("other", ["weight", "bias", "input"])
def test_running_statistics_overlapping_an_input_are_refused(other):
    p = training_problem()
    buffer = np.concatenate([p["running_mean"], p["weight"], p["bias"]])
    p["weight"], p["bias"] = buffer[3:6], buffer[6:9]
    rm = buffer[0:3] if other == "input" else buffer[3:6] if other == "weight" else buffer[6:9]
    if other == "input":
        p["input"] = np.lib.stride_tricks.as_strided(buffer, SHAPE, (0, 8, 0))
    _raises(
        Status.BAD_PARAM, lambda: _forward(p, rm, p["running_var"].copy()), "running_mean", other
    )


def test_interleaved_running_statistics_are_not_aliases():
    """``buf[0::2]`` and ``buf[1::2]`` share no element: accepted, results torch's."""
    p = training_problem(1)
    buffer = np.empty(6)
    rm, rv = buffer[0::2], buffer[1::2]
    rm[...], rv[...] = p["running_mean"], p["running_var"]
    outputs = _forward(p, rm, rv, momentum=0.3)
    want = torch_training(p, momentum=0.3)
    for got, expected in zip((*outputs, rm, rv), want, strict=True):
        assert_close(got, expected, np.float64)


def test_cupyx_mean_is_inv_std_is_refused():
    p = training_problem()
    shared = np.zeros(3)
    rm = p["running_mean"].copy()
    _raises(
        Status.BAD_PARAM,
        lambda: cudnn.batch_normalization_forward_training(
            p["input"],
            p["weight"],
            p["bias"],
            rm,
            None,
            shared,
            shared,
            1e-5,
            0.9,
            True,
            cudnn.CUDNN_BATCHNORM_SPATIAL,
            False,
        ),
        "mean",
        "inv_std",
    )
    np.testing.assert_array_equal(rm, p["running_mean"])


# --- finding 5: only InfiniError escapes ---------------------------------------------------

ESCAPES = {
    "batched_list_input": lambda: cudnn_bn.batch_norm_backward_batched(
        [[[1.0]]], np.ones((1, 2, 3)), np.ones(3), None, None
    ),
    "batched_short_grad_output": lambda: cudnn_bn.batch_norm_backward_batched(
        np.ones((3, 2, 3, 4)), np.ones((1, 2, 3, 4)), np.ones(3), None, None
    ),
    "batched_list_weight": lambda: cudnn_bn.batch_norm_backward_batched(
        np.ones((3, 2, 3, 4)), np.ones((3, 2, 3, 4)), [1.0, 1.0, 1.0], None, None
    ),
    "batched_short_per_problem_stats": lambda: cudnn_bn.batch_norm_backward_batched(
        np.ones((3, 2, 3, 4)), np.ones((3, 2, 3, 4)), np.ones((2, 3)), None, None
    ),
    "batched_none_grad_output": lambda: cudnn_bn.batch_norm_backward_batched(
        np.ones((3, 2, 3, 4)), None, np.ones(3), None, None
    ),
    "fold_torch": lambda: cudnn_bn.fold_conv_bn(
        torch.ones(3, 2, 1, 1), None, torch.ones(3), None, None, None, 1e-5
    ),
    "fold_list": lambda: cudnn_bn.fold_conv_bn([[1.0]], None, None, None, None, None, 1e-5),
    "fold_mixed": lambda: cudnn_bn.fold_conv_bn(
        np.ones((3, 2)), torch.ones(3), None, None, None, None, 1e-5
    ),
    "cupyx_list_x": lambda: cudnn.batch_normalization_forward_inference(
        [[1.0, 2.0]], np.ones(2), np.zeros(2), np.zeros(2), np.ones(2), 1e-5, False, 1
    ),
    "cupyx_bad_mode": lambda: cudnn.batch_normalization_forward_inference(
        np.ones((2, 2)), np.ones(2), np.zeros(2), np.zeros(2), np.ones(2), 1e-5, False, 7
    ),
    "cupyx_torch_gamma": lambda: cudnn.batch_normalization_forward_inference(
        np.ones((2, 2)), torch.ones(2), np.zeros(2), np.zeros(2), np.ones(2), 1e-5, False, 1
    ),
    "cupyx_empty_x": lambda: cudnn.batch_normalization_forward_inference(
        np.ones((2, 0)), np.ones(0), np.zeros(0), np.zeros(0), np.ones(0), 1e-5, False, 1
    ),
    "cupyx_nhwc_param_size": lambda: cudnn.batch_normalization_forward_inference(
        np.ones((2, 2, 2, 3)), *[np.ones(5)] * 4, 1e-5, True, 0, cudnn.CUDNN_TENSOR_NHWC
    ),
    "cupyx_backward_gy_shape": lambda: cudnn.batch_normalization_backward(
        np.ones((4, 3)), np.ones(3), np.ones((2, 3)), np.zeros(3), np.ones(3), 1e-5, False, 1, False
    ),
}


@pytest.mark.parametrize("call", ESCAPES.values(), ids=ESCAPES.keys())
def test_only_infini_errors_escape(call):
    with pytest.raises(Exception) as caught:  # the type is what is checked
        call()
    assert isinstance(caught.value, InfiniError), repr(caught.value)
    assert caught.value.status != Status.INTERNAL_ERROR, str(caught.value)


def test_status_classes_derive_from_the_natural_builtins():
    assert isinstance(InfiniError(Status.BAD_PARAM, "x"), ValueError)
    assert isinstance(InfiniError(Status.BAD_TENSOR_SHAPE, "x"), ValueError)
    assert isinstance(InfiniError(Status.BAD_TENSOR_STRIDES, "x"), ValueError)
    assert isinstance(InfiniError(Status.BAD_TENSOR_DTYPE, "x"), TypeError)
    assert type(InfiniError(Status.BAD_PARAM, "x")) is BadParamError


# --- finding 8: messages name arguments as the caller spelled them -------------------------


def test_array_api_messages_name_arrays_not_descriptors():
    p = random_values(SHAPE, 0, bias=True)
    x, w, b = p["input"], p["weight"], p["bias"]
    error = _raises(
        Status.NULL_POINTER,
        lambda: cudnn_bn.batch_norm_forward_training(x, w, b, None, None, fusion="add_relu"),
        "z is None",
    )
    assert "_desc" not in str(error) and "is NULL" not in str(error)
    error = _raises(
        Status.BAD_TENSOR_SHAPE,
        lambda: cudnn_bn.batch_norm_backward(x, x[:, :, :2], w, None, None),
        "grad_output has shape",
    )
    assert "_desc" not in str(error)
    error = _raises(
        Status.NULL_POINTER,
        lambda: cudnn_bn.batch_norm_backward(x, x, w, None, None, mode="eval"),
        "running_mean is None",
    )
    error = _raises(
        Status.BAD_TENSOR_DTYPE,
        lambda: cudnn_bn.batch_norm_forward_inference(x, w, b, w, w.astype(np.float32)),
        "running_var",
    )
    assert "_desc" not in str(error)


def test_cupyx_messages_name_cupy_arguments():
    p = random_values(SHAPE, 0, bias=True)
    x, w, b, rm, rv = (p[n] for n in ("input", "weight", "bias", "running_mean", "running_var"))
    spatial = cudnn.CUDNN_BATCHNORM_SPATIAL
    error = _raises(
        Status.BAD_PARAM,
        lambda: cudnn.batch_normalization_forward_training(
            x, w, b, rm.copy(), rv.copy(), None, None, 1e-5, 1.5, True, spatial, False
        ),
        "decay",
        "1.5",
    )
    assert "momentum" not in str(error) and "-0.5" not in str(error)
    error = _raises(
        Status.BAD_TENSOR_DTYPE,
        lambda: cudnn.batch_normalization_backward(
            x.astype(np.float32), w, x, rm, rv, 1e-5, True, spatial, False
        ),
        "gy",
    )
    assert "grad_output" not in str(error)
    _raises(
        Status.BAD_TENSOR_SHAPE,
        lambda: cudnn.batch_normalization_forward_inference(
            x, w[:2], b, rm, rv, 1e-5, True, spatial
        ),
        "gamma",
    )


# --- finding 9: fold_conv_bn's dtypes and variances; NumPy scalars ---------------------------


def test_fold_refuses_integer_weights_and_negative_variances():
    weight = np.arange(12).reshape(3, 4)
    _raises(
        Status.BAD_TENSOR_DTYPE,
        lambda: cudnn_bn.fold_conv_bn(weight, None, None, None, None, None, 1e-5),
        "conv_weight",
    )
    error = _raises(
        Status.BAD_PARAM,
        lambda: cudnn_bn.fold_conv_bn(
            weight.astype(np.float32), None, None, None, None, np.array([1.0, -2.0, 1.0]), 1e-5
        ),
        "running_var",
    )
    assert "negative" in str(error)
    _raises(
        Status.BAD_TENSOR_DTYPE,
        lambda: cudnn_bn.fold_conv_bn(
            weight.astype(np.float32), np.arange(3), None, None, None, None, 1e-5
        ),
        "conv_bias",
    )


def test_numpy_scalars_are_accepted_where_python_ones_are():
    p = random_values(SHAPE, 3)
    x, dy, w, rm, rv = (
        p[n] for n in ("input", "grad_output", "weight", "running_mean", "running_var")
    )
    got = cudnn_bn.batch_norm_backward(
        x, dy, w, rm, rv, mode=np.int64(2), eps=np.float32(0.5),
        output_mask=(np.True_, np.True_, np.False_), persistent=np.False_,
    )  # fmt: skip
    want = reference(x, dy, w, mode="eval", eps=float(np.float32(0.5)), mean=rm, var=rv)
    assert_close(got[0], want[0], np.float64)
    assert_close(got[1], want[1], np.float64)
    assert got[2] is None
    folded = cudnn_bn.fold_conv_bn(
        np.ones((3, 2), np.float32), None, None, None, None, None, np.float64(1e-5), np.False_
    )
    assert folded[0].shape == (3, 2)
