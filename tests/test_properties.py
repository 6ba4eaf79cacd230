"""Property tests (hypothesis): random problems against PyTorch, random layouts against brute force.

Where the table-driven tests pick cases, these draw them: shapes of rank 2-5 with small
random sizes, random channel count, random mode and eps, and strides that are row-major,
channels-last, padded or permuted. The CPU backend must agree with PyTorch's float64
backward and training forward (output, saved and running statistics) on every one, and
``TensorDesc.overlaps`` must never call an overlapping layout free (it may be conservative
on exotic interleavings, never wrong the other way).
"""

import itertools

import numpy as np
import pytest
import torch
from helpers import assert_close, reference

pytest.importorskip("hypothesis")  # a test extra; the GPU machine may not have it
from hypothesis import given, settings
from hypothesis import strategies as st

import cudnn_bn
from cudnn_bn import DataType, TensorDesc

shapes = st.integers(2, 5).flatmap(
    lambda rank: st.tuples(st.integers(1, 4), st.integers(1, 5), *[st.integers(1, 4)] * (rank - 2))
)


def _arrange(array: np.ndarray, layout: str, rng: np.random.Generator) -> np.ndarray:
    """The same values in another memory layout (a view into a bigger or permuted buffer)."""
    if layout == "channels_last" and array.ndim > 2:
        order = (0, *range(2, array.ndim), 1)
        return np.ascontiguousarray(array.transpose(order)).transpose(np.argsort(order))
    if layout == "padded":
        big = rng.standard_normal([n + 2 for n in array.shape]).astype(array.dtype)
        view = big[tuple(slice(1, 1 + n) for n in array.shape)]
        view[...] = array
        return view
    if layout == "permuted":
        order = rng.permutation(array.ndim)
        return np.ascontiguousarray(array.transpose(order)).transpose(np.argsort(order))
    return array


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from([np.float32, np.float64]),
    mode=st.sampled_from(["train", "saved", "eval"]),
    eps=st.sampled_from([0.0, 1e-5, 1e-2]),
    layouts=st.tuples(
        *[st.sampled_from(["contiguous", "channels_last", "padded", "permuted"])] * 2
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpu_backward_matches_torch(shape, dtype, mode, eps, layouts, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape).astype(dtype) * 2 + 0.5
    dy = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.5, 1.5, c).astype(dtype)
    axes = (0, *range(2, len(shape)))
    if mode == "saved":
        mean, var = x.astype(np.float64).mean(axes), x.astype(np.float64).var(axes)
    else:
        mean, var = rng.standard_normal(c), rng.uniform(0.5, 2.0, c)
    mean, var = mean.astype(dtype), var.astype(dtype)
    if eps == 0.0 and (mode == "train" or mode == "saved") and np.prod(shape) // c == 1:
        eps = 1e-5  # one value per channel has zero variance: invstd would be infinite
    got = cudnn_bn.batch_norm_backward(
        _arrange(x, layouts[0], rng), _arrange(dy, layouts[1], rng), w,
        None if mode == "train" else mean, None if mode == "train" else var, eps=eps, mode=mode,
    )  # fmt: skip
    want = reference(x, dy, w, mode=mode, eps=eps, mean=mean, var=var)
    for actual, expected in zip(got, want, strict=True):
        assert_close(actual, expected, torch.float64 if dtype == np.float64 else torch.float32)


def _brute_force_overlaps(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    addresses = [
        sum(i * s for i, s in zip(index, strides, strict=True))
        for index in itertools.product(*map(range, shape))
    ]
    return len(set(addresses)) < len(addresses)


@settings(max_examples=400, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    data=st.data(),
)
def test_overlap_check_never_misses_an_overlap(shape, data):
    strides = tuple(
        data.draw(st.lists(st.integers(0, 12), min_size=len(shape), max_size=len(shape)))
    )
    desc = TensorDesc(DataType.F32, tuple(shape), strides)
    if _brute_force_overlaps(desc.shape, strides):
        assert desc.overlaps()
    if desc.is_contiguous() or desc.is_channels_last():
        assert not desc.overlaps()


@settings(max_examples=100, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from([np.float32, np.float64]),
    momentum=st.sampled_from([0.0, 0.1, 1.0]),
    layout=st.sampled_from(["contiguous", "channels_last", "padded", "permuted"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpu_forward_training_matches_torch(shape, dtype, momentum, layout, seed):
    if np.prod(shape) == shape[1]:
        shape = (shape[0] + 1, *shape[1:])  # training needs two values per channel
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape).astype(dtype) * 2 + 0.5
    w, b = rng.uniform(0.5, 1.5, c).astype(dtype), rng.standard_normal(c).astype(dtype)
    mean, var = rng.standard_normal(c).astype(dtype), rng.uniform(0.5, 2.0, c).astype(dtype)
    t_mean, t_var = (
        torch.from_numpy(mean.astype(np.float64)),
        torch.from_numpy(var.astype(np.float64)),
    )
    y, saved_mean, saved_invstd = cudnn_bn.batch_norm_forward_training(
        _arrange(x, layout, rng), w, b, mean, var, momentum=momentum, eps=1e-5
    )
    t_x, t_w, t_b = (torch.from_numpy(a.astype(np.float64)) for a in (x, w, b))
    want_y, want_mean, want_invstd = torch.ops.aten.native_batch_norm(
        t_x, t_w, t_b, t_mean, t_var, True, momentum, 1e-5
    )
    tol = torch.float64 if dtype == np.float64 else torch.float32
    for got, want in (
        (y, want_y),
        (saved_mean, want_mean),
        (saved_invstd, want_invstd),
        (mean, t_mean),
        (var, t_var),
    ):
        assert_close(got, want, tol)
