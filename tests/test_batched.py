"""``batch_norm_backward_batched`` on the CPU: ``B`` independent problems ``(B, N, C, ...)``
with weight ``(C,)`` (shared) or ``(B, C)``, statistics ``(B, C)``.

Against a Python loop of ``batch_norm_backward`` (bit for bit: the same kernel on the same
values), and against PyTorch in float64: ``torch.func.vmap`` of
``torch.ops.aten.native_batch_norm_backward`` for the training formula, a loop of it per
problem for "eval" (functorch's batch rule for that op needs saved statistics). Tolerances
are InfiniCore's (``helpers.TOL``): 2e-5 for F32, 1e-2 for F16/BF16, a few ulps.
"""

import numpy as np
import pytest
import torch
from helpers import assert_close, convert, f64, tolerance_dtype

import cudnn_bn
from cudnn_bn import InfiniError, Status, batch_norm_backward, batch_norm_backward_batched
from cudnn_bn.api import batched_pass

EPS = 1e-5
SHAPES = [(3, 4, 2), (3, 4, 2, 5), (2, 2, 3, 4, 5)]  # (B, N, C, ...)
DTYPES = [  # (data dtype, per-channel dtype)
    (np.float32, np.float32),
    (np.float64, np.float64),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
]
MASK = [True, True, True]


@pytest.fixture(autouse=True, params=["folded", "in place"])
def strategy(request, monkeypatch) -> str:
    """Every test both ways a CPU batch runs (``batched_pass``): folded (small problems)
    and in place (here at any size), from an empty plan cache."""
    cudnn_bn.descriptor_cache.clear()
    if request.param == "in place":
        monkeypatch.setattr(batched_pass, "MIN_VALUES", 0)
    return request.param


def problem(shape, data, channel, weight_shape: str, seed=0) -> dict:
    """Batched input and grad_output, weight ``(C,)`` or ``(B, C)``, statistics ``(B, C)``."""
    rng = np.random.default_rng(seed)
    b, c = shape[0], shape[2]
    values = {
        "input": (rng.standard_normal(shape) * 2 + 0.5, data),
        "grad_output": (rng.standard_normal(shape), data),
        "weight": (rng.uniform(0.5, 1.5, (c,) if weight_shape == "shared" else (b, c)), channel),
        "running_mean": (rng.standard_normal((b, c)) * 0.3, channel),
        "running_var": (rng.uniform(0.5, 2.0, (b, c)), channel),
    }
    return {name: convert(v, dtype) for name, (v, dtype) in values.items()}


def weight_of(p: dict, b: int):
    return p["weight"][b] if p["weight"].ndim == 2 else p["weight"]


def torch_batched(p: dict, mode: str) -> tuple[torch.Tensor, ...]:
    """float64 gradients of every problem, stacked."""
    x, dy, rm, rv = (f64(p[n]) for n in ("input", "grad_output", "running_mean", "running_var"))
    w = f64(p["weight"]).expand(x.shape[0], x.shape[2])  # (B, C) either way
    if mode == "eval":
        per_problem = [
            torch.ops.aten.native_batch_norm_backward(
                dy[b], x[b], w[b], rm[b], rv[b], None, None, False, EPS, MASK
            )
            for b in range(x.shape[0])
        ]
        return tuple(torch.stack(g) for g in zip(*per_problem, strict=True))
    if mode == "train":
        forward = torch.func.vmap(
            lambda x, w: torch.ops.aten.native_batch_norm(x, w, None, None, None, True, 0.0, EPS)
        )
        _, mean, invstd = forward(x, w)
    else:  # "saved": the running statistics are the batch mean and biased variance
        mean, invstd = rm, 1.0 / torch.sqrt(rv + EPS)
    return torch.func.vmap(
        lambda dy, x, w, mean, invstd: torch.ops.aten.native_batch_norm_backward(
            dy, x, w, None, None, mean, invstd, True, EPS, MASK
        )
    )(dy, x, w, mean, invstd)


def arguments(p: dict, mode: str) -> tuple:
    running = (None, None) if mode == "train" else (p["running_mean"], p["running_var"])
    return p["input"], p["grad_output"], p["weight"], *running


@pytest.mark.parametrize("weight_shape", ["shared", "batched"])
@pytest.mark.parametrize("mode", ["train", "saved", "eval"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_against_loop_and_torch(data, channel, shape, mode, weight_shape):
    p = problem(shape, data, channel, weight_shape)
    got = batch_norm_backward_batched(*arguments(p, mode), eps=EPS, mode=mode)
    b, c = shape[0], shape[2]
    assert [tuple(g.shape) for g in got] == [shape, (b, c), (b, c)]
    assert all(type(g) is type(p["input"]) for g in got)
    assert got[0].dtype == p["input"].dtype and got[1].dtype == p["weight"].dtype

    for i in range(b):
        running = (None, None) if mode == "train" else (p["running_mean"][i], p["running_var"][i])
        one = batch_norm_backward(
            p["input"][i], p["grad_output"][i], weight_of(p, i), *running, eps=EPS, mode=mode
        )
        for batched, single in zip(got, one, strict=True):
            np.testing.assert_array_equal(f64(batched[i]).numpy(), f64(single).numpy())

    for actual, expected in zip(got, torch_batched(p, mode), strict=True):
        assert_close(actual, expected, tolerance_dtype(data))


@pytest.mark.parametrize("weight_shape", ["shared", "batched"])
def test_saved_mean_and_invstd_per_problem(weight_shape):
    """``(B, C)`` saved statistics from a vmapped forward go straight in."""
    p = problem((3, 4, 2, 5), np.float32, np.float32, weight_shape)
    x, w = f64(p["input"]), f64(p["weight"]).expand(3, 2)
    _, mean, invstd = torch.func.vmap(
        lambda x, w: torch.ops.aten.native_batch_norm(x, w, None, None, None, True, 0.0, EPS)
    )(x, w)
    got = batch_norm_backward_batched(
        p["input"], p["grad_output"], p["weight"], None, None, mode="saved",
        saved_mean=mean.float().numpy(), saved_invstd=invstd.float().numpy(),
    )  # fmt: skip
    for actual, expected in zip(got, torch_batched(p, "train"), strict=True):
        assert_close(actual, expected, np.float32)


def test_output_mask():
    p = problem((3, 4, 2, 5), np.float32, np.float32, "batched")
    full = batch_norm_backward_batched(*arguments(p, "eval"), mode="eval")
    got = batch_norm_backward_batched(
        *arguments(p, "eval"), mode="eval", output_mask=(False, True, False)
    )
    assert got[0] is None and got[2] is None
    np.testing.assert_array_equal(got[1], full[1])


@pytest.mark.parametrize(
    ("change", "status"),
    [
        (dict(input=np.zeros((4, 3), np.float32)), Status.BAD_TENSOR_SHAPE),
        (dict(output_mask=(True, True)), Status.BAD_PARAM),
        (dict(mode="nope"), Status.BAD_PARAM),
    ],
    ids=["rank-2 input", "bad mask", "bad mode"],
)
def test_bad_arguments(change, status):
    p = problem((3, 4, 2, 5), np.float32, np.float32, "shared")
    args = dict(zip(("input", "grad_output", "weight"), arguments(p, "train"), strict=False))
    args |= change
    with pytest.raises(InfiniError) as error:
        batch_norm_backward_batched(
            args.pop("input"), args.pop("grad_output"), args.pop("weight"), None, None, **args
        )
    assert error.value.status == status


def test_problems_with_no_values_give_zero_gradients():
    p = problem((3, 0, 2, 5), np.float32, np.float32, "batched")
    gi, gw, gb = batch_norm_backward_batched(*arguments(p, "train"))
    assert gi.shape == (3, 0, 2, 5)
    np.testing.assert_array_equal(gw, np.zeros((3, 2), np.float32))
    np.testing.assert_array_equal(gb, np.zeros((3, 2), np.float32))


@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
def test_fused_backward_per_problem(fusion):
    """A fused forward's backward (its output and bias, ``(B, C)`` or shared), as each
    problem's ``batch_norm_backward`` alone, grad_z included."""
    p = problem((3, 4, 2, 5), np.float32, np.float32, "batched")
    rng = np.random.default_rng(3)
    y = np.maximum(rng.standard_normal(p["input"].shape), 0).astype(np.float32)
    bias = rng.standard_normal(2).astype(np.float32)
    got = batch_norm_backward_batched(
        p["input"], p["grad_output"], p["weight"], None, None, fusion=fusion, output=y, bias=bias
    )
    assert len(got) == (4 if fusion == "add_relu" else 3)
    for i in range(3):
        one = batch_norm_backward(
            p["input"][i], p["grad_output"][i], p["weight"][i], None, None,
            fusion=fusion, output=y[i], bias=bias,
        )  # fmt: skip
        for batched_result, single in zip(got, one, strict=True):
            np.testing.assert_array_equal(batched_result[i], single)


def test_no_weight_and_reversed_views_per_problem():
    """``weight=None`` (ones, no grad_weight) on views with negative strides: gathered by
    the fold (the backward refuses negative strides, so such a batch never runs in place)."""
    p = problem((3, 4, 2, 5), np.float64, np.float64, "shared")
    x, dy = p["input"][::-1, :, ::-1], p["grad_output"][:, ::-1]
    gi, gw, gb = batch_norm_backward_batched(x, dy, None, None, None)
    assert gw is None
    for i in range(3):
        one = batch_norm_backward(x[i].copy(), dy[i].copy(), None, None, None)
        np.testing.assert_array_equal(gi[i], one[0])
        np.testing.assert_array_equal(gb[i], one[2])
