"""The CPU engine's own promises (cudnn_bn/backends/cpu.py, cpu_kernels.py, cpu_layout.py),
against references it did not write: torch in float64, NumPy's float16, torch's bfloat16.

- accuracy where a one-pass engine could lose it: 1e7 values per channel with a mean far
  from zero, constant channels (exactly zero variance), eps 0;
- the parallel path (large problems split across threads) in every layout walk;
- outputs that overlap inputs, in the same layout or another;
- F16/BF16 conversions bit for bit; F16/BF16 forwards (float32 inside) within one ulp of
  float64 on every element; the extra memory of one call; the thread count.
"""

import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import channels_last, padded_strides
from numba.core.registry import CPUDispatcher

import cudnn_bn
import cudnn_bn.nn
from cudnn_bn.backends import cpu, cpu_kernels, cpu_pool
from cudnn_bn.enums import DataType
from cudnn_bn.ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from cudnn_bn.problems import BackwardAttributes, BackwardPointers, BackwardTensors, Mode
from cudnn_bn.runtime import Handle
from cudnn_bn.tensor import TensorDesc, contiguous_strides

EPS = 1e-5


def laid_out(values: np.ndarray, strides, dtype=np.float32) -> np.ndarray:
    """``values`` as a ``dtype`` array with element ``strides`` (gaps filled with NaN)."""
    size = 1 + sum((n - 1) * s for n, s in zip(values.shape, strides, strict=True))
    flat = np.full(size, np.nan, dtype=dtype)
    item = np.dtype(dtype).itemsize
    out = np.lib.stride_tricks.as_strided(flat, values.shape, [s * item for s in strides])
    out[...] = values
    return out


def desc(a: np.ndarray, dtype=DataType.F32) -> TensorDesc:
    return TensorDesc(dtype, a.shape, tuple(s // a.itemsize for s in a.strides))


def torch_backward(x, dy, w, eps=EPS):
    """float64 (grad_input, grad_weight, grad_bias) of training-mode batch norm."""
    x, dy, w = (torch.from_numpy(np.asarray(a, np.float64)) for a in (x, dy, w))
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, None, None, None, True, 0.1, eps)
    return torch.ops.aten.native_batch_norm_backward(
        dy, x, w, None, None, mean, invstd, True, eps, [True, True, True]
    )


def f64(a) -> torch.Tensor:
    return (
        a.double() if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a, np.float64))
    )


def assert_close(got, want, tol=2e-5) -> None:
    torch.testing.assert_close(f64(got), f64(want), atol=tol, rtol=tol)


def assert_backwards_as_torch(x, dy, w, mean, invstd, tol=2e-5) -> None:
    """Both backwards, train mode and from the forward's saved ``mean``/``invstd``, as
    torch's training-mode backward in float64."""
    want = torch_backward(x, dy, w)
    train = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    saved = cudnn_bn.batch_norm_backward(
        x, dy, w, None, None, mode="saved", saved_mean=mean, saved_invstd=invstd
    )
    for got in (train, saved):
        for g, v in zip(got, want, strict=True):
            assert_close(g, v, tol)


# --- accuracy ------------------------------------------------------------------------------


def test_ten_million_values_per_channel_with_a_far_mean():
    """1e7 values in one channel, mean 100 and spread 0.1: a one-pass variance in float32, or
    sums without a shift, would lose the variance; ours stays within F32's tolerance."""
    rng = np.random.default_rng(0)
    shape = (10, 1, 1_000_000)
    x = (100.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    w, b = np.array([1.5], np.float32), np.array([0.25], np.float32)
    rm, rv = np.zeros(1, np.float32), np.ones(1, np.float32)
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, rm, rv, momentum=1.0)
    x64 = torch.from_numpy(x.astype(np.float64))
    want_y, want_mean, want_invstd = torch.ops.aten.native_batch_norm(
        x64, torch.tensor([1.5], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64),
        None, None, True, 0.1, EPS,
    )  # fmt: skip
    assert_close(y, want_y)
    assert_close(mean, want_mean)
    assert_close(invstd, want_invstd)
    assert_close(rv, x64.var(unbiased=True).reshape(1))
    for got, want in zip(cudnn_bn.batch_norm_backward(x, dy, w, None, None),
                         torch_backward(x, dy, w), strict=True):  # fmt: skip
        assert_close(got, want)


def test_constant_channel():
    """A constant channel has exactly zero variance: its output is the bias and its
    grad_input w/sqrt(eps) * (dy - mean(dy))."""
    rng = np.random.default_rng(1)
    shape = (64, 2, 2048)  # parallel-sized: 262144 values
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, 1] = 3.3  # not a power of two: a naive mean would not subtract to zero
    dy = rng.standard_normal(shape).astype(np.float32)
    w, b = np.array([0.5, 2.0], np.float32), np.array([0.0, -0.75], np.float32)
    y, _, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    gi, gw, gb = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    want = torch_backward(x[:, :1], dy[:, :1], w[:1])
    assert_close(gi[:, 0], want[0][:, 0])
    assert_close(gb, dy.astype(np.float64).sum((0, 2)), 1e-4)
    assert invstd[1] == np.float32(1 / np.sqrt(EPS))
    assert (y[:, 1] == b[1]).all()
    dy1 = dy[:, 1].astype(np.float64)
    assert_close(gi[:, 1], w[1] / np.sqrt(EPS) * (dy1 - dy1.mean()), 2e-4)
    assert gw[1] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("path", ["stepwise", "one_call", "threads"])
def test_eps_zero_constant_channel_has_torchs_invstd_0(path, layout, dtype, monkeypatch):
    """A constant channel with eps 0 has invstd 0, as torch's ``InvStd`` gives it
    (``native_batch_norm`` in float64): the output is the bias, grad_input and grad_weight
    0, in the forward and both backwards, in every path that computes the statistics. The
    formula's 1/sqrt(0) made invstd inf and the rest NaN."""
    shape = (4, 2, 64, 512) if path == "threads" else (2, 2, 4, 8)
    rng = np.random.default_rng(8)
    x = rng.standard_normal(shape)
    x[:, 1] = 3.25  # exact in every dtype: torch's float64 variance of it is 0 too
    dy = rng.standard_normal(shape)
    if layout == "nhwc":
        x, dy = (laid_out(a, channels_last(shape), dtype) for a in (x, dy))
    else:
        x, dy = x.astype(dtype), dy.astype(dtype)
    per_channel = np.float64 if dtype is np.float64 else np.float32
    w, b = np.array([0.5, 2.0], per_channel), np.array([0.25, -0.75], per_channel)
    monkeypatch.setattr(cpu, "STEPWISE_CALLS", 1 << 30 if path == "stepwise" else 0)
    monkeypatch.setattr(cpu, "_ONE_CALL_DTYPES", set())
    monkeypatch.setattr(cpu, "THREADS_MIN_VALUES", cpu.PARALLEL_MIN_VALUES)
    previous = cpu_pool.thread_count()
    cpu_pool.set_thread_count(2 if path == "threads" else 1)
    try:
        y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None, eps=0.0)
        train = cudnn_bn.batch_norm_backward(x, dy, w, None, None, eps=0.0)
        saved = cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, eps=0.0, mode="saved", saved_mean=mean, saved_invstd=invstd
        )
    finally:
        cpu_pool.set_thread_count(previous)
    x64, dy64, w64 = f64(x), f64(dy), f64(w)
    want_y, want_mean, want_invstd = torch.ops.aten.native_batch_norm(
        x64, w64, f64(b), None, None, True, 0.1, 0.0
    )
    want = torch.ops.aten.native_batch_norm_backward(
        dy64, x64, w64, None, None, want_mean, want_invstd, True, 0.0, [True, True, True]
    )
    assert want_invstd[1] == 0 and invstd[1] == 0
    assert (f64(y[:, 1]) == f64(b)[1]).all()
    tol = 2e-3 if dtype is np.float16 else 2e-5
    assert_close(y, want_y, tol)
    for got in (train, saved):
        assert (f64(got[0][:, 1]) == 0).all() and got[1][1] == 0
        for g, wanted in zip(got, want, strict=True):
            assert_close(g, wanted, tol * 10)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_an_infinite_first_value_gives_torchs_infinite_mean(dtype, layout):
    """A training channel whose first value is infinite (the sums' shift) has torch's mean
    and running mean: inf or -inf (NaN for both infinities), as where an infinity comes
    later. Taken as the shift, it made every x - k NaN (inf - inf), and the mean NaN."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 2, 2)).astype(dtype)
    x[0, :3, 0, 0] = np.inf, -np.inf, np.inf  # first values of each sign
    x[0, 1, 0, 1] = x[2, 2, 1, 1] = x[1, 3, 0, 0] = -np.inf  # both signs in channel 2
    if layout == "nhwc":
        x = laid_out(x, channels_last(x.shape), dtype)
    per_channel = np.float64 if dtype is np.float64 else np.float32
    rm, rv = np.zeros(4, per_channel), np.ones(4, per_channel)
    y, mean, _ = cudnn_bn.batch_norm_forward_training(x, None, None, rm, rv, momentum=0.5)
    want_rm, want_rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    want = torch.ops.aten.native_batch_norm(f64(x), None, None, want_rm, want_rv, True, 0.5, EPS)
    np.testing.assert_array_equal(mean, want[1].numpy().astype(per_channel))
    np.testing.assert_array_equal(rm, want_rm.numpy().astype(per_channel))
    np.testing.assert_array_equal(np.asarray(y, np.float64), want[0].numpy())  # NaN


@pytest.mark.parametrize("path", ["stepwise", "one_call", "threads"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_f64_channel_of_tiny_deviations_is_not_taken_for_constant(path, layout, monkeypatch):
    """An F64 channel whose deviations (1e-200) square to 0 in float64 is not constant: its
    training output is (x - mean) * invstd * w + bias as torch's (invstd 1/sqrt(eps), the
    variance 0 in float64 too), not the bias alone. Only narrow data (whose nonzero
    deviations square to 2**-298 at least) may take a zero sum of squares for a constant
    channel (``cpu_kernels.channel_results``), in every path that computes it."""
    shape = (2, 2, 64, 512) if path == "threads" else (2, 2, 4, 8)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape)
    x[:, 1] = rng.integers(-3, 4, x[:, 1].shape) * 1e-200
    x[0, 1, 0, 0] = 0.0  # the channel's first value, which shifts its sums
    if layout == "nhwc":
        x = laid_out(x, channels_last(shape), np.float64)
    w, b = np.array([0.5, 2.0]), np.array([0.25, 0.0])
    monkeypatch.setattr(cpu, "STEPWISE_CALLS", 1 << 30 if path == "stepwise" else 0)
    monkeypatch.setattr(cpu, "_ONE_CALL_DTYPES", set())  # else F64's, once compiled, runs
    monkeypatch.setattr(cpu, "THREADS_MIN_VALUES", cpu.PARALLEL_MIN_VALUES)
    previous = cpu_pool.thread_count()
    cpu_pool.set_thread_count(2 if path == "threads" else 1)
    try:
        y, _, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    finally:
        cpu_pool.set_thread_count(previous)
    want, _, want_invstd = torch.ops.aten.native_batch_norm(
        torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(w), torch.from_numpy(b),
        None, None, True, 0.1, EPS,
    )  # fmt: skip
    assert invstd[1] == want_invstd[1]
    assert (y[:, 1] != 0).any()
    torch.testing.assert_close(torch.from_numpy(y[:, 1]), want[:, 1], rtol=1e-12, atol=0)
    assert_close(y, want, 1e-10)


# --- every walk, serial and parallel ---------------------------------------------------------


def _x_layouts(shape):
    mixed = (contiguous_strides(shape), channels_last(shape), padded_strides(shape))
    return {
        "nchw": (contiguous_strides(shape),) * 3,
        "channels_last": (channels_last(shape),) * 3,
        "padded": (padded_strides(shape),) * 3,
        "mixed": mixed,
    }


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "padded", "mixed"])
@pytest.mark.parametrize("shape", [(4, 8, 2, 32, 32), (2, 1, 64, 1024), (32768, 3)], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_large_problems_in_every_layout(layout, shape, threads, monkeypatch):
    """Problems of >= 65536 values take the parallel path (``threads`` > 1; here from 65536
    values, not ``cpu.THREADS_MIN_VALUES``): channel-outer walks split channels and rows,
    channels-innermost walks split rows."""
    monkeypatch.setattr(cpu, "THREADS_MIN_VALUES", cpu.PARALLEL_MIN_VALUES)
    rng = np.random.default_rng(2)
    x64 = rng.standard_normal(shape) * 2 + 1
    dy64 = rng.standard_normal(shape)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    sx, sd, sg = _x_layouts(shape)[layout]
    x, dy = laid_out(x64, sx), laid_out(dy64, sd)
    gi = laid_out(np.zeros(shape), sg)
    gw, gb = np.empty_like(w), np.empty_like(w)
    previous = cpu_pool.thread_count()
    cpu_pool.set_thread_count(threads)
    try:
        kernel = cpu.BatchNormBackward(
            BackwardTensors(desc(gi), desc(gw), desc(gb), desc(x), desc(dy), desc(w), None, None),
            BackwardAttributes(eps=EPS, mode=Mode.TRAIN),
        )
        assert kernel.parallel
        kernel.run(BackwardPointers(*(a.ctypes.data for a in (gi, gw, gb, x, dy, w)), 0, 0), 0, 0)
    finally:
        cpu_pool.set_thread_count(previous)
    for got, want in zip((gi, gw, gb), torch_backward(x, dy, w), strict=True):
        assert_close(got, want)
    y = cudnn_bn.batch_norm_forward_inference(x, w, w, w, np.abs(w))
    want_y = torch.nn.functional.batch_norm(
        *(torch.from_numpy(np.asarray(a, np.float64)) for a in (x, w, np.abs(w), w, w)),
        training=False, eps=EPS,
    )  # fmt: skip
    assert_close(y, want_y)


@pytest.mark.parametrize("layout", ["nchw", "padded", "mixed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_blocks_of_channels_as_torch(layout, dtype, monkeypatch):
    """A one-call pass with sums walks channel-outer data a block of channels at a time
    (``cpu_kernels.BLOCK_BYTES``; here 9 to 18 blocks of 5 or 6 channels, uneven): every
    pass, fused or not, as torch's in float64, and the stepwise path's results bit for
    bit (one block)."""
    monkeypatch.setattr(cpu, "STEPWISE_CALLS", 0)
    monkeypatch.setattr(cpu, "_ONE_CALL_DTYPES", set())
    shape = (4, 100, 29, 37)
    c, item = shape[1], np.dtype(dtype).itemsize
    assert 9 <= 3 * item * np.prod(shape) // cpu_kernels.BLOCK_BYTES < c
    rng = np.random.default_rng(11)
    sx, sd, sg = _x_layouts(shape)[layout]
    x = laid_out(rng.standard_normal(shape) * 2 + 30, sx, dtype)
    dy, z = (
        laid_out(rng.standard_normal(shape), sd, dtype),
        laid_out(rng.standard_normal(shape), sg, dtype),
    )
    w, b = rng.uniform(0.5, 1.5, c).astype(dtype), rng.standard_normal(c).astype(dtype)
    tol = 2e-5 if dtype == np.float32 else 1e-10
    t = {k: f64(v) for k, v in dict(x=x, dy=dy, z=z, w=w, b=b).items()}
    gi, gw, gb = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    for got, want in zip((gi, gw, gb), torch_backward(x, dy, w), strict=True):
        assert_close(got, want, tol)
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    want = torch.ops.aten.native_batch_norm(t["x"], t["w"], t["b"], None, None, True, 0.1, EPS)
    for got, w64 in zip((y, mean, invstd), want, strict=True):
        assert_close(got, w64, tol)
    fused = cudnn_bn.nn.BatchNorm(c, fusion="add_relu")
    y = fused(x, z=z)
    xt = t["x"].clone().requires_grad_()
    zt = t["z"].clone().requires_grad_()
    yt = torch.relu(
        F.batch_norm(
            xt,
            None,
            None,
            torch.ones(c, dtype=torch.float64),
            torch.zeros(c, dtype=torch.float64),
            training=True,
            eps=EPS,
        )
        + zt
    )
    yt.backward(t["dy"])
    assert_close(y, yt.detach(), tol)
    for got, want in zip(fused.backward(dy)[:2], (xt.grad, zt.grad), strict=True):
        assert_close(got, want, tol)


@pytest.mark.parametrize("layout", ["nchw", "padded", "mixed"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=str)
def test_blocks_on_threads_as_on_one(layout, dtype, monkeypatch):
    """On two threads, a pass whose runs stay in one channel has its blocks of channels
    claimed by both (``cpu_kernels.blocks_pass``; here from ``cpu.PARALLEL_MIN_VALUES``, at
    least 8 blocks, of about ``cpu_kernels.BLOCK_BYTES`` where that makes more), with the
    results of one thread bit for bit: every pass, fused or not, and every per-channel
    output."""
    shape = (4, 100, 29, 37)
    rng = np.random.default_rng(12)
    sx, sd, sg = _x_layouts(shape)[layout]
    x = laid_out(rng.standard_normal(shape) * 2 + 30, sx, dtype)
    dy, z = (laid_out(rng.standard_normal(shape), s, dtype) for s in (sd, sg))
    w, b = rng.uniform(0.5, 1.5, 100).astype(dtype), rng.standard_normal(100).astype(dtype)
    mean, var = rng.standard_normal(100).astype(dtype), rng.uniform(1, 2, 100).astype(dtype)
    monkeypatch.setattr(cpu, "THREADS_MIN_VALUES", cpu.PARALLEL_MIN_VALUES)
    handed = []
    team = cpu_pool.team
    monkeypatch.setattr(cpu_pool, "team", lambda *a: handed.append(a[1]) or team(*a))

    def passes():
        stats = [mean.copy(), var.copy()]
        return [
            *cudnn_bn.batch_norm_backward(x, dy, w, None, None),
            *cudnn_bn.batch_norm_backward(x, dy, w, mean, var, mode="eval"),
            *cudnn_bn.batch_norm_forward_training(x, w, b, *stats, z=z, fusion="add_relu"),
            *stats,
            cudnn_bn.batch_norm_forward_inference(x, w, b, mean, var),
        ]

    previous = cpu_pool.thread_count()
    try:
        cpu_pool.set_thread_count(1)
        one = passes()
        cpu_pool.set_thread_count(2)
        handed.clear()
        two = passes()
    finally:
        cpu_pool.set_thread_count(previous)
    assert len(handed) == 4 and min(handed) >= 8  # each pass's blocks, handed over once
    if dtype == np.float64:  # 8-byte data: blocks of BLOCK_BYTES outnumber 8
        assert min(handed[:3]) > 8
    for got, want in zip(two, one, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, True), (True, False, False)])
@pytest.mark.parametrize("shape", [(16, 64, 16, 16), (64, 3, 32, 32)], ids=str)
def test_rows_on_threads_for_every_output_mask(mask, shape, monkeypatch):
    """Channels innermost, or too few channels for blocks: two threads share work items of
    rows (``cpu_kernels.rows_pass``), each step waiting for the one before; a backward
    that writes no grad_input has no elementwise step, and the call still returns (run
    in a thread here, so that a wait that never ends fails the test). As torch's in
    float64."""
    monkeypatch.setattr(cpu, "THREADS_MIN_VALUES", cpu.PARALLEL_MIN_VALUES)
    rng = np.random.default_rng(13)
    n, c, h, w_ = shape
    x, dy = (np.moveaxis(rng.standard_normal((n, h, w_, c)), -1, 1) for _ in range(2))
    w = rng.uniform(0.5, 1.5, c)
    handed, got = [], []
    team = cpu_pool.team
    monkeypatch.setattr(cpu_pool, "team", lambda *a: handed.append(a[1]) or team(*a))
    previous = cpu_pool.thread_count()
    cpu_pool.set_thread_count(2)
    try:
        call = threading.Thread(
            target=lambda: got.extend(
                cudnn_bn.batch_norm_backward(x, dy, w, None, None, output_mask=mask)
            ),
            daemon=True,
        )
        call.start()
        call.join(60)
        assert not call.is_alive(), "the threaded backward never returned"
    finally:
        cpu_pool.set_thread_count(previous)
    assert len(handed) == 1 and handed[0] >= 2  # one hand-off, items for both threads
    for g, want in zip(got, torch_backward(x, dy, w), strict=True):
        if g is not None:
            assert_close(g, want, 1e-10)
    assert [g is not None for g in got] == list(mask)


@pytest.mark.parametrize("shape", [(1, 3, 49), (3, 3, 49), (5, 2, 7, 7), (3, 64, 1024)], ids=str)
def test_sums_over_an_odd_number_of_rows(shape):
    """The channel-outer walks sum two rows per loop; a lone last row (odd row counts; one
    row) is a pair with itself, its sums halved: every pass's sums (x alone, x and dy,
    dy alone with given statistics) as torch's in float64."""
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal(shape) * 3 + 100, rng.standard_normal(shape)
    w, b = rng.uniform(0.5, 1.5, shape[1]), rng.standard_normal(shape[1])
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    t = (torch.from_numpy(a) for a in (x, w, b))
    want_y, want_mean, want_invstd = torch.ops.aten.native_batch_norm(
        *t, None, None, True, 0.1, EPS
    )
    for got, want in ((y, want_y), (mean, want_mean), (invstd, want_invstd)):
        assert_close(got, want, 1e-11)
    assert_backwards_as_torch(x, dy, w, mean, invstd, 1e-10)


@pytest.mark.parametrize("strided", ["x", "dy", "output"])
@pytest.mark.parametrize("shape", [(3, 4, 49), (2, 3, 5, 16)], ids=str)
def test_one_operand_strided_along_its_runs(strided, shape):
    """The channel-outer walks have a loop of their own where every operand they read or
    write is packed along a run (``cpu_kernels.UNIT_RUNS``): one operand with every other
    element (the rest packed) takes the general loop, in each pass, as torch in float64."""
    rng = np.random.default_rng(4)
    x, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    x = x * 3 + 100
    if strided == "x":
        x = np.repeat(x, 2, axis=-1)[..., ::2]
    if strided == "dy":
        dy = np.repeat(dy, 2, axis=-1)[..., ::2]
    wide = np.full((*shape[:-1], 2 * shape[-1]), np.nan, np.float32)
    output = wide[..., ::2] if strided == "output" else None
    w, b = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32), np.ones(shape[1], np.float32)
    axes = (0, *range(2, len(shape)))
    mean = x.mean(axis=axes, dtype=np.float64).astype(np.float32)
    var = x.var(axis=axes, dtype=np.float64).astype(np.float32)
    invstd = (1 / np.sqrt(var.astype(np.float64) + EPS)).astype(np.float32)
    named = dict(x=x, dy=dy, w=w, b=b, mean=mean, var=var, invstd=invstd)
    t = {k: f64(v) for k, v in named.items()}
    got = cudnn_bn.batch_norm_backward(
        x, dy, w, None, None, mode="saved", saved_mean=mean, saved_invstd=invstd,
        out=(output, None, None),
    )  # fmt: skip
    want = torch.ops.aten.native_batch_norm_backward(
        t["dy"], t["x"], t["w"], None, None, t["mean"], t["invstd"], True, EPS, [True] * 3
    )
    for g, v in zip(got, want, strict=True):
        assert_close(g, v)
    if output is not None:
        assert got[0] is output
    assert_backwards_as_torch(x, dy, w, mean, invstd)
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, mean, var, out=output)
    want_y = F.batch_norm(t["x"], t["mean"], t["var"], t["w"], t["b"], training=False, eps=EPS)
    assert_close(y, want_y)


@pytest.mark.parametrize("rows", [1, 2, 5], ids=lambda r: f"{r}_rows")
def test_channels_last_rows_of_two_dimensions(rows):
    """Channels-last data whose rows do not merge into one dimension (a gap after each image
    row): the across walks take such rows' offsets by decomposing the row index, not by the
    one-dimension multiply of dense data; every pass (odd and even row counts, a lone row)
    as torch's in float64."""
    shape = (rows, 16, 1, 5) if rows < 5 else (3, 16, rows, 7)
    _, c, h, w = shape
    strides = (h * (w + 1) * c, 1, (w + 1) * c, c)  # one pixel's gap after each image row
    rng = np.random.default_rng(4)
    x64, dy64 = rng.standard_normal(shape) * 3 + 10, rng.standard_normal(shape)
    x, dy = laid_out(x64, strides), laid_out(dy64, strides)
    w8, b8 = rng.uniform(0.5, 1.5, c), rng.standard_normal(c)
    weight, bias = w8.astype(np.float32), b8.astype(np.float32)
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, weight, bias, None, None)
    xs = torch.from_numpy(np.asarray(x, np.float64))
    want_y, want_mean, want_invstd = torch.ops.aten.native_batch_norm(
        xs, *(torch.from_numpy(np.asarray(a, np.float64)) for a in (weight, bias)), None, None,
        True, 0.1, EPS,
    )  # fmt: skip
    for got, want in ((y, want_y), (mean, want_mean), (invstd, want_invstd)):
        assert_close(got, want)
    rv = np.abs(bias) + 0.5
    inference = cudnn_bn.batch_norm_forward_inference(x, weight, bias, bias, rv)
    want_inference = F.batch_norm(
        xs, *(torch.from_numpy(np.asarray(a, np.float64)) for a in (bias, rv, weight, bias)),
        training=False, eps=EPS,
    )  # fmt: skip
    assert_close(inference, want_inference)
    assert_backwards_as_torch(x, dy, weight, mean, invstd)


@pytest.mark.parametrize("interpreted", [True, False], ids=["numpy", "compiled"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "bfloat16"], ids=str)
def test_first_calls_step_by_step_give_the_one_call_passs_results(
    monkeypatch, layout, dtype, interpreted
):
    """A problem's first calls (``cpu.STEPWISE_CALLS``) run the steps from Python, their
    per-channel steps NumPy's and the interpreter's or compiled (``cpu.INTERPRETED_COLUMNS``);
    later calls run the one-call pass: the same results, bit for bit, for every pass, fused
    or not, in either walk."""
    monkeypatch.setattr(cpu, "INTERPRETED_COLUMNS", 1 << 62 if interpreted else 0)
    dtype = half_dtype(dtype) if dtype == "bfloat16" else dtype  # its per-channel tensors too
    shape = (16, 8, 33, 31)  # 131k values: a problem the one-call pass serves on one thread
    rng = np.random.default_rng(7)
    strides = contiguous_strides(shape) if layout == "nchw" else channels_last(shape)
    x, dy, z = (laid_out(rng.standard_normal(shape) + 3, strides, dtype) for _ in range(3))
    w = rng.uniform(0.5, 2, 8).astype(np.float32 if dtype == np.float16 else dtype)
    b = rng.standard_normal(8).astype(w.dtype)

    def passes() -> list[np.ndarray]:
        out = [*cudnn_bn.batch_norm_backward(x, dy, w, None, None)]
        out += cudnn_bn.batch_norm_forward_training(x, w, b, b.copy(), w.copy())
        out.append(cudnn_bn.batch_norm_forward_inference(x, w, b, b, w))
        fused = cudnn_bn.nn.BatchNorm(8, fusion="add_relu")
        out += [fused(x, z=z), *fused.backward(dy)]
        return out

    monkeypatch.setattr(cpu, "_ONE_CALL_DTYPES", set())
    monkeypatch.setattr(cpu, "STEPWISE_CALLS", 1 << 30)
    first = passes()
    monkeypatch.setattr(cpu, "STEPWISE_CALLS", 0)
    later = passes()
    assert all(np.array_equal(f, g, equal_nan=True) for f, g in zip(first, later, strict=True))


def test_per_channel_steps_are_compiled_once_the_processs_budget_is_spent(monkeypatch):
    """Step-by-step calls make their per-channel steps in NumPy and the interpreter until
    they have taken ``cpu.INTERPRETED_COLUMNS`` in all, then call the compiled ones: the
    interpreter's 8 us a column is bounded."""
    monkeypatch.setattr(cpu, "INTERPRETED_COLUMNS", 100)
    monkeypatch.setattr(cpu, "_interpreted_columns", [0])
    assert cpu._per_channel_steps(64) == (cpu._numpy_copy, cpu._interpreted_results)
    compiled = (cpu.cpu_kernels.copy_channels, cpu.cpu_kernels.channel_results)
    assert cpu._per_channel_steps(64) == compiled


def test_first_calls_write_a_per_channel_overflow_as_inf_without_a_warning(monkeypatch):
    """A step-by-step call's per-channel results beyond their dtype's range are written as
    inf, as the compiled copy writes them, with no warning: NumPy's cast warned "overflow
    encountered in cast", an error under ``-W error``."""
    monkeypatch.setattr(cpu, "INTERPRETED_COLUMNS", 1 << 62)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((32, 64, 8, 8)) * 300).astype(np.float16)  # variance 9e4
    w, b = np.ones(64, np.float16), np.zeros(64, np.float16)
    rm, rv = np.zeros(64, np.float16), np.ones(64, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cudnn_bn.batch_norm_forward_training(x, w, b, rm, rv, momentum=1.0)
    assert np.isinf(rv).all()


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"], ids=str)
def test_first_calls_read_a_signaling_nan_as_the_compiled_copy_does(monkeypatch, dtype):
    """A signaling NaN in a per-channel tensor or among x's first values, read by a
    step-by-step call's NumPy copy: made quiet without a word, as the compiled copy reads it.
    NumPy's F32/BF16-to-float64 cast flagged it ("invalid value encountered in cast"): a
    warning, an error under ``-W error``, and under the caller's ``np.seterr(all="raise")``
    a FloatingPointError (INTERNAL_ERROR) from the first calls alone."""
    dtype = half_dtype(dtype) if dtype == "bfloat16" else dtype
    signaling = 0x7F81 if dtype != np.float32 else 0x7F800001
    bits = np.uint16 if dtype != np.float32 else np.uint32
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 8, 33, 31)).astype(dtype)  # 131k values: step by step
    x[0, 5, 0, 0:1].view(bits)[0] = signaling  # channel 5's first value
    w, b = np.ones(8, dtype), np.zeros(8, dtype)
    w[3:4].view(bits)[0] = signaling
    monkeypatch.setattr(cpu, "_ONE_CALL_DTYPES", set())
    monkeypatch.setattr(cpu, "STEPWISE_CALLS", 1 << 30)
    results = []
    for budget in (1 << 62, 0):  # NumPy's and the interpreter's steps, then the compiled
        monkeypatch.setattr(cpu, "INTERPRETED_COLUMNS", budget)
        with warnings.catch_warnings(), np.errstate(all="raise"):
            warnings.simplefilter("error")
            out = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
            out = [*out[:3], *cudnn_bn.batch_norm_backward(x, x, w, None, None)]
        results.append([np.asarray(a).view(np.uint8) for a in out])
    assert all(np.array_equal(f, g) for f, g in zip(*results, strict=True))
    assert np.isnan(np.asarray(results[0][0].view(dtype), np.float64)[:, 3]).all()


# --- speed ---------------------------------------------------------------------------------


def test_along_runs_are_written_in_their_walks():
    """A compiled helper's call passes each array with an atomic reference count increment
    and decrement: per run of a channel, that cost short runs ((8, 2048, 7, 7): 49 values)
    more than their arithmetic (backward 1.5x torch's time), so the run loops are written
    in the item kernels. Nor is a helper inlined by numba (``inline="always"``) but the
    across walks, each called by one kernel alone (``cpu_kernels.inlined``): inlining
    copies and types the callee's IR again at each call site, 0.1-0.2 s of the README
    block's first call per item kernel."""
    k = cpu_kernels
    functions = [f for f in vars(k).values() if isinstance(f, CPUDispatcher)]
    inlined = [f.__name__ for f in functions if f.targetoptions.get("inline") == "always"]
    assert inlined == ["_sums_across", "_forward_across", "_backward_across"]
    for per_run in ("_sums_along", "_forward_along", "_backward_along"):
        assert not hasattr(k, per_run)


# --- overlapping outputs -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 16, 32, 32), (7, 16, 7, 7)], ids=str)
@pytest.mark.parametrize("same_layout", [True, False], ids=["same_layout", "other_layout"])
def test_grad_input_over_grad_output(same_layout, shape):
    """grad_input written over grad_output's memory: in place in the same layout, or in
    another layout (through scratch); either way the gradients of the original dy. An odd
    row count: the backward pairs rows, and its last row is written as a pair with itself."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = np.ascontiguousarray(rng.standard_normal(shape).astype(np.float32))
    w = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    want = torch_backward(x, dy, w)
    if same_layout:
        gi = dy
    else:  # the same bytes seen channels-last
        gi = np.lib.stride_tricks.as_strided(
            dy, shape, [s * 4 for s in channels_last(shape)], writeable=True
        )
    for got, w_ in zip(backward_into(gi, x, dy, w), want, strict=True):
        assert_close(got, w_)


def backward_into(gi: np.ndarray, x: np.ndarray, dy: np.ndarray, w: np.ndarray) -> tuple:
    """``(grad_input, grad_weight, grad_bias)`` of the CPU kernel run on ``grad_input`` ``gi``
    (which may be ``dy``'s memory) with ``run``, its overlap rule included."""
    gw, gb = np.empty_like(w), np.empty_like(w)
    kernel = cpu.BatchNormBackward(
        BackwardTensors(desc(gi), desc(gw), desc(gb), desc(x), desc(dy), desc(w), None, None),
        BackwardAttributes(eps=EPS),
    )
    kernel.run(BackwardPointers(*(a.ctypes.data for a in (gi, gw, gb, x, dy, w)), 0, 0), 0, 0)
    return gi, gw, gb


@pytest.mark.parametrize("shape", [(7, 3, 5, 5), (3, 512, 1, 3)], ids=str)
def test_channels_last_outputs_over_their_inputs(shape):
    """Channels-last outputs written in place over their inputs: inference's y over x, the
    backward's grad_input over grad_output. Odd row counts (5 tiles of 35 rows at C = 3, 9
    rows at C = 512): the channels-last walk pairs rows, its last row with itself."""
    rng = np.random.default_rng(5)
    c = shape[1]
    xv, dyv = rng.standard_normal(shape) + 3.0, rng.standard_normal(shape)
    w, b = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    mean, var = rng.standard_normal(c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    x, dy = laid_out(xv, channels_last(shape)), laid_out(dyv, channels_last(shape))
    want_y = F.batch_norm(f64(x), f64(mean), f64(var), f64(w), f64(b), False, 0, EPS)
    want_grads = torch_backward(x, dy, w)
    pc = desc(w)
    op = BatchNormForwardInferenceDescriptor(
        Handle(cudnn_bn.Device.CPU, 0), desc(x), desc(x), pc, pc, pc, pc
    )
    op.compute(0, 0, *(a.ctypes.data for a in (x, x, w, b, mean, var)))
    assert_close(x, want_y)
    x = laid_out(xv, channels_last(shape))
    for got, want in zip(backward_into(dy, x, dy, w), want_grads, strict=True):
        assert_close(got, want)


def test_inference_output_over_its_input_transposed():
    """The output written channels-last over its NCHW input's memory: through scratch."""
    rng = np.random.default_rng(4)
    shape = (4, 8, 64, 64)
    x = rng.standard_normal(shape).astype(np.float32)
    w, b = rng.uniform(0.5, 1.5, 8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    mean, var = rng.standard_normal(8).astype(np.float32), rng.uniform(0.5, 2, 8).astype(np.float32)
    t = {
        k: torch.from_numpy(v.astype(np.float64))
        for k, v in dict(x=x, w=w, b=b, m=mean, v=var).items()
    }
    want = torch.nn.functional.batch_norm(t["x"], t["m"], t["v"], t["w"], t["b"], False, 0, EPS)
    out = np.lib.stride_tricks.as_strided(
        x, shape, [s * 4 for s in channels_last(shape)], writeable=True
    )
    pc = desc(w)
    op = BatchNormForwardInferenceDescriptor(
        Handle(cudnn_bn.Device.CPU, 0), desc(out), desc(x), pc, pc, pc, pc
    )
    op.compute(
        0,
        0,
        out.ctypes.data,
        x.ctypes.data,
        w.ctypes.data,
        b.ctypes.data,
        mean.ctypes.data,
        var.ctypes.data,
    )
    assert_close(out, want)


# --- conversions ---------------------------------------------------------------------------


BROADCASTS = [  # (shape, the shape an operand is broadcast from: zero strides)
    ((2, 1), (1, 1)),
    ((4, 3, 5), ()),
    ((4, 3, 5), (1, 3, 5)),
    ((4, 3, 5), (4, 1, 5)),
    ((4, 3, 5), (4, 3, 1)),
    ((2, 8, 3, 3), (1, 8, 1, 1)),
    ((64, 3, 40), (1, 3, 40)),
]


@pytest.mark.parametrize(("shape", "source"), BROADCASTS, ids=str)
def test_broadcast_operands(shape, source):
    """A zero stride is a present operand's (torch's ``expand`` makes such gradients), read
    element by element, never taken for an absent tensor."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = np.broadcast_to(rng.standard_normal(source).astype(np.float32), shape)
    w = rng.standard_normal(shape[1]).astype(np.float32)
    for got, want in zip(
        cudnn_bn.batch_norm_backward(x, dy, w, None, None), torch_backward(x, dy, w), strict=True
    ):
        assert_close(got, want)
    x = np.broadcast_to(rng.standard_normal(source).astype(np.float32), shape)
    mean, var = np.zeros(shape[1], np.float32), np.ones(shape[1], np.float32)
    got = cudnn_bn.batch_norm_forward_inference(x, w, w, mean, var, eps=EPS)
    want = F.batch_norm(f64(x), f64(mean), f64(var), f64(w), f64(w), False, 0.0, EPS)
    assert_close(got, want)


def _channel(address: int, code: DataType) -> tuple[np.ndarray, np.ndarray]:
    """One per-channel tensor (slot 0, element stride 1) as ``copy_channels`` takes it."""
    at = np.zeros(cpu_kernels.CHANNEL_SLOTS, np.int64)
    args = np.tile(np.array([1, int(DataType.F64)], np.int64), (cpu_kernels.CHANNEL_SLOTS, 1))
    at[0], args[0, 1] = address, int(code)
    return at, args


def _load(values: np.ndarray, code: DataType) -> np.ndarray:
    table = np.zeros((cpu_kernels.CHANNEL_SLOTS, values.size))
    at, args = _channel(values.ctypes.data, code)
    cpu_kernels.copy_channels(at, args, 1, table, table[0, :0], -1, False)
    return table[0]


def _store(values: np.ndarray, code: DataType) -> np.ndarray:
    out = np.empty(values.size, np.uint16)
    table = np.zeros((cpu_kernels.CHANNEL_SLOTS, values.size))
    table[0] = values
    at, args = _channel(out.ctypes.data, code)
    cpu_kernels.copy_channels(at, args, 1, table, table[0, :0], -1, True)
    return out


def _float64_values() -> np.ndarray:
    """Random float64 bit patterns around half range, exact ties, and the edges."""
    rng = np.random.default_rng(5)
    around = rng.uniform(-17, 17, 300_000)  # exponents of 2 from 2**-17 (subnormal) to 2**17
    values = np.sign(rng.standard_normal(300_000)) * 2.0**around
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    finite = halves[np.isfinite(halves)]
    ties = (finite[:-1] + finite[1:]) / 2  # exactly between two halves
    edges = [0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, np.inf, -np.inf, np.nan,
             2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-14, 1e-300, 1e300]  # fmt: skip
    return np.concatenate([values, ties, edges])


def test_f16_reads_every_bit_pattern_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float64)
    got = _load(bits, DataType.F16)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


def test_f16_writes_round_once_to_nearest_even():
    """float64 -> half in one rounding, as NumPy's ``astype(float16)``, ties included."""
    values = _float64_values()
    with np.errstate(over="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    got = _store(values, DataType.F16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


def test_bf16_reads_and_writes_as_torch():
    """BF16 reads are exact; writes round through float32 as torch does."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).double().numpy()
    got = _load(bits, DataType.BF16)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    values = _float64_values()
    rounded = torch.from_numpy(values).float().to(torch.bfloat16)
    want_bits = rounded.view(torch.int16).numpy().view(np.uint16)
    got_bits = _store(values, DataType.BF16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])
    assert np.isnan(rounded[torch.from_numpy(nan)].float().numpy()).all()


# --- memory and threads --------------------------------------------------------------------

_MEMORY_SCRIPT = """
import numpy as np, cudnn_bn
def rss_peak():  # this process's high-water mark (getrusage's would start at the parent's)
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
small = np.ones((4, 8, 4, 4), np.float32)
cudnn_bn.batch_norm_backward(small, small, np.ones(8, np.float32), None, None)
shape = (16, 64, 128, 128)
rng = np.random.default_rng(0)
x = rng.standard_normal(shape, dtype=np.float32)
dy = rng.standard_normal(shape, dtype=np.float32)
w = np.ones(64, np.float32)
before = rss_peak()
cudnn_bn.batch_norm_backward(x, dy, w, None, None)
print(rss_peak() - before, x.nbytes)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_one_backward_needs_at_most_its_outputs_in_extra_memory():
    """Peak RSS growth of one F32 backward on a 64 MiB input: grad_input (1x) and a little,
    where the float64 engine took about 10x."""
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, check=True
    )
    extra, input_bytes = map(int, result.stdout.split())
    assert extra <= 1.25 * input_bytes, (extra, input_bytes)


def test_thread_count_follows_omp_num_threads():
    script = "from cudnn_bn.backends import cpu_pool; print(cpu_pool.thread_count())"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("NUMBA_NUM_THREADS", None)
    capped = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    assert capped.stdout.strip() == "1"
    env.pop("OMP_NUM_THREADS")
    free = subprocess.run(
        [sys.executable, "-c", script + "; import numba; print(numba.config.NUMBA_NUM_THREADS)"],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    count, numba_count = free.stdout.split()
    assert count == numba_count


def half_steps(got, want) -> np.ndarray:
    """Distance between F16/BF16 arrays in representable values."""
    g, h = (np.asarray(a).view(np.int16).astype(np.int64) for a in (got, want))
    return np.abs(np.where(g < 0, -32768 - g, g) - np.where(h < 0, -32768 - h, h))


def half_dtype(name: str):
    return np.float16 if name == "float16" else pytest.importorskip("ml_dtypes").bfloat16


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize(("offset", "spread"), [(0, 1), (1e4, 30), (-1e4, 8), (0, 1e-4)])
def test_half_forward_within_one_ulp_of_float64(dtype, offset, spread):
    """F16/BF16 forwards (float32 elementwise, as torch) stay within one ulp of the float64
    result rounded once, on every element; a constant channel is exact."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(3)
    c = 8
    x = (offset + spread * rng.standard_normal((512, c, 64))).astype(dtype)
    x[:, 0] = x[0, 0, 0]
    w, b = rng.uniform(-3, 3, c).astype(np.float32), rng.uniform(-3, 3, c).astype(np.float32)
    xs = x.astype(np.float64)
    mean, var = xs.mean(axis=(0, 2)), xs.var(axis=(0, 2))
    rm = (mean + 0.1 * spread * rng.standard_normal(c)).astype(np.float32)
    rv = (var * rng.uniform(0.5, 2, c)).astype(np.float32)

    def rounded(m, v):
        y = (xs - m[:, None]) * (w / np.sqrt(v + EPS))[:, None] + b.astype(np.float64)[:, None]
        return (y if dtype is np.float16 else y.astype(np.float32)).astype(dtype)

    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=EPS)
    want = rounded(rm.astype(np.float64), rv.astype(np.float64))
    assert half_steps(y, want).max() <= 1
    np.testing.assert_array_equal(np.asarray(y)[:, 0].view(np.int16), want[:, 0].view(np.int16))
    y, *_ = cudnn_bn.batch_norm_forward_training(x, w, b, np.zeros(c, np.float32), None)
    assert half_steps(y, rounded(mean, var)).max() <= 1


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize(
    ("name", "value", "weight", "eps"),
    [
        ("float16", -3.140625, -0.28746727108955383, 0.8195865750312805),
        ("bfloat16", 1.75, 0.30751344561576843, 1.170753836631775),
        ("bfloat16", 3e38, -3e38, 1e-30),  # scale -3e53, beyond float32
    ],
)
def test_half_training_constant_channel_is_exactly_the_bias(name, value, weight, eps, layout):
    """A constant F16/BF16 channel's training output is its bias rounded once, even for a
    bias halfway between two values of the dtype: ``(x - t)*a + c`` (``cpu_kernels.
    _crossing``'s form) rounds ``(x - mean)*scale`` and tips it to the wrong side for these
    values (found by simulating the form); and where the scale is beyond float32 (its
    float32 pass made ``0 * inf``, NaN)."""
    dtype = half_dtype(name)
    tie = 1 + 2.0 ** (-11 if name == "float16" else -8)  # halfway between 1 and the next
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3, 8, 8)).astype(dtype)
    x[:, 1] = dtype(value)
    if layout == "NHWC":
        x = laid_out(x, channels_last(x.shape), dtype)
    w = np.array([0.7, weight, -1.3], np.float32)
    b = np.array([0.25, tie, -2.0], np.float32)
    y, *_ = cudnn_bn.batch_norm_forward_training(x, w, b, None, None, eps=eps)
    want = np.float32(tie).astype(dtype)
    np.testing.assert_array_equal(np.asarray(y)[:, 1].view(np.int16), want.view(np.int16))


def torch_inference(x, w, b, rm, rv, dtype) -> np.ndarray:
    """torch's float64 inference forward of ``x``, rounded once to ``dtype`` (BF16 through
    float32, as torch rounds)."""
    t = [torch.from_numpy(np.asarray(a, np.float64)) for a in (x, rm, rv, w, b)]
    y = F.batch_norm(t[0], t[1], t[2], t[3], t[4], False, 0.0, EPS).numpy()
    return (y if dtype is np.float16 else y.astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize(
    ("offset", "spread"), [(0, 1), (0, 1e-4), (0, 1e3), (1e4, 30), (-1e4, 1), (1e4, 1e-2)]
)
def test_f32_forward_within_1e_6_of_float64(layout, offset, spread):
    """F32 forwards stay within 1e-6 relative of torch's float64 result on every element,
    training and inference, even where y cancels to near zero (a plain float32 elementwise
    pass, torch's, does not); a constant channel gives exactly the bias, NaN and inf come
    out as torch's."""
    rng = np.random.default_rng(6)
    c = 16
    x = (offset + spread * rng.standard_normal((64, c, 16, 16))).astype(np.float32)
    x[:, 0] = x[0, 0, 0, 0]
    x[0, 1, 0, 0], x[1, 2, 3, 4], x[2, 3, 5, 6] = np.inf, -np.inf, np.nan
    if layout == "NHWC":
        x = laid_out(x, channels_last(x.shape))
    w, b = rng.uniform(-3, 3, c).astype(np.float32), rng.uniform(-3, 3, c).astype(np.float32)
    xs = torch.from_numpy(x.astype(np.float64))
    mean, var = xs.mean((0, 2, 3)), xs.var((0, 2, 3), unbiased=False)
    rm = (mean + 0.1 * spread * torch.from_numpy(rng.standard_normal(c))).float().numpy()
    rv = (var * torch.from_numpy(rng.uniform(0.5, 2, c))).float().numpy()
    rv[1:4] = 1.0  # the channels with NaN and inf
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=EPS)
    train, *_ = cudnn_bn.batch_norm_forward_training(x, w, b, None, None, eps=EPS)
    t = [torch.from_numpy(np.asarray(a, np.float64)) for a in (w, b)]
    want_train = F.batch_norm(xs, None, None, *t, True, 0.0, EPS).float().numpy()
    assert (train[:, 0] == b[0]).all()
    for got, want in ((y, torch_inference(x, w, b, rm, rv, np.float32)), (train, want_train)):
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[~finite], want[~finite])
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=0)


# F32 channels where a float32 elementwise pass is not within 1e-6 of float64 unless it is
# done with care: (x values, weight, bias, mean, var, eps) for the inference forward, with
# the training forward given the same x.
_F32_EXTREMES = {
    # y crosses zero among the data, 1e4 from 0: a plain float32 x*a + c (torch's F32)
    # cancels there; the crossing form makes x - t exact.
    "crossing-at-1e4": (-1e4 + np.arange(-8, 8) * 2.0**-9, 1.0, 1e4, 0.0, 1.0, EPS),
    # Subnormal outputs (1.4e-40): the float32 scale rounds these the other way from the
    # float64 one, 1e-5 relative; the crossing is at 0 (|t*scale| < 2**-96): float64.
    "subnormal-outputs": ((141700 + 10 * np.arange(16)) * 2.0**-149, 0.7, 0.0, 0.0, 1.0, EPS),
    # A constant channel (training: exactly the bias); the crossing form rounds it 1 ulp off.
    "constant": ([-0.0071568172] * 16, 1.0237464904785156, 0.6923106908798218, 0.5, 1.0, 0.6475423),
    # y = 3.40282360e38 rounds to inf; with the float32 scale it is 3.4028235e38 (the
    # largest float32): |x| beyond the item's limit takes float64.
    "overflow-rounding": ([3e38, -3e38] * 8, 1.6041064262390137, 0.0, 1.0, 2.0, 0.0),
    # The same where the crossing is so far out (t*scale 2.7e38) that no |x| keeps y below
    # 2**127: the item's limit is negative, and the guard took its magnitude for the bound
    # (an |x| of 4.3e18 passed it, one y rounded to -3.4028235e38 where float64's is -inf).
    "overflow-far-out": (-4.2676483e18 + np.arange(-8, 8) * 2**39, 1.6e19, 0, 1.7e19, 1, 0),
    # A variance of 1e-30 with eps 0: a scale of 1e15, values 1e-15 apart.
    "tiny-variance": (0.5 + np.arange(-8, 8) * 2.0**-24, 0.3, -0.2, 0.5, 1e-30, 0.0),
    # A bias 1e12 times the result: the crossing 1e12 from the data.
    "large-bias": (np.linspace(-3, 3, 16), 1.0, 1e12, 0.0, 1.0, EPS),
    # Offsets of 1e30 a few ulps wide, a scale of 1e-15: t beyond 2**64, float64.
    "offset-1e30": (1e30 * (1 + np.arange(-8, 8) * 2.0**-23), 1e-15, 0.5, 1e30, 1.0, 0.0),
    # NaN and infinities beside finite values near the crossing.
    "nan-and-inf": ([np.nan, np.inf, -np.inf, 0.25] * 4, -1.5, 0.375, 0.0, 1.0, EPS),
}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", sorted(_F32_EXTREMES))
def test_f32_forward_of_extreme_channels_within_1e_6_of_float64(case, layout):
    """F32 forwards of channels that a careless float32 pass gets wrong (cancellation,
    subnormal outputs, float32's overflow, tiny variances, huge offsets and biases, NaN and
    inf; a constant channel trains to exactly its bias) stay within 1e-6 relative of the
    float64 result on every element, with the same infinities and NaN, beside a tame
    channel (an item of both: channels-last walks every channel in one), inference and
    training. The reference is (x - mean)*scale + bias in float64, rounded once: torch's
    float64 inference computes x*scale + (bias - mean*scale), which itself cancels (1e-18
    where the result is 0)."""
    values, weight, bias, mean, var, eps = _F32_EXTREMES[case]
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 2, 2, 2)).astype(np.float32)
    x[:, 1] = np.asarray(values, np.float32).reshape(4, 2, 2)
    w, b = np.array([0.5, weight], np.float32), np.array([0.25, bias], np.float32)
    rm, rv = np.array([0.1, mean], np.float32), np.array([2.0, var], np.float32)
    xs, col = x.astype(np.float64), (lambda a: a.astype(np.float64)[None, :, None, None])
    batch_mean = xs.mean(axis=(0, 2, 3), keepdims=True)
    batch_var = ((xs - batch_mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        want_inference = (xs - col(rm)) * (col(w) / np.sqrt(col(rv) + eps)) + col(b)
        want_training = (xs - batch_mean) * (col(w) / np.sqrt(batch_var + eps)) + col(b)
    if layout == "NHWC":
        x = laid_out(x, channels_last(x.shape))
    got_inference = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=eps)
    got_training, *_ = cudnn_bn.batch_norm_forward_training(x, w, b, None, None, eps=eps)
    if np.ptp(values) == 0:
        assert (got_training[:, 1] == b[1]).all()
    for got, want in ((got_inference, want_inference), (got_training, want_training)):
        with np.errstate(over="ignore"):
            want = want.astype(np.float32)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[~finite], want[~finite])
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_half_inference_within_one_ulp_on_every_half_value(name):
    """Every finite F16/BF16 value through channels whose statistics span 1e-6 to 1e4: the
    one-ulp promise of the compensated float32 pass on all inputs, not a sample."""
    dtype = half_dtype(name)
    values = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    values = values[np.isfinite(values.astype(np.float32))]
    rng = np.random.default_rng(5)
    c = 12
    x = np.repeat(values[:, None, None], c, axis=1)
    w, b = rng.uniform(-3, 3, c).astype(np.float32), rng.uniform(-3, 3, c).astype(np.float32)
    b[:2] = 0
    rm = (rng.standard_normal(c) * 10.0 ** rng.integers(-6, 5, c)).astype(np.float32)
    rv = (10.0 ** rng.uniform(-8, 8, c)).astype(np.float32)
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=EPS)
    with np.errstate(over="ignore"):
        want = torch_inference(x, w, b, rm, rv, dtype)
    finite = np.isfinite(want.astype(np.float32))
    assert half_steps(y, want)[finite].max() <= 1
    np.testing.assert_array_equal(np.isfinite(np.asarray(y).astype(np.float32)), finite)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_half_inference_keeps_infinite_inputs_infinite(name, layout):
    """An infinite input gives torch's infinite output, not NaN: the compensation terms
    (infinite times a low part of either sign) must not reach it."""
    dtype = half_dtype(name)
    rng = np.random.default_rng(2)
    c = 8
    x = rng.standard_normal((4, c, 3, 3)).astype(dtype)
    x[0, :, 0, 0], x[1, :, 1, 2], x[3, :, 2, 1] = np.inf, -np.inf, np.nan
    if layout == "NHWC":
        x = laid_out(x, channels_last(x.shape), dtype)
    w, b = rng.uniform(-3, 3, c).astype(np.float32), rng.uniform(-3, 3, c).astype(np.float32)
    rm = rng.standard_normal(c).astype(np.float32)
    rv = rng.uniform(0.1, 3, c).astype(np.float32)
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=EPS)
    want = torch_inference(x, w, b, rm, rv, dtype)
    np.testing.assert_array_equal(np.asarray(y).astype(np.float32), want.astype(np.float32))


# Channels whose float32 working values leave float32's normal range: (dtype, x values,
# weight, bias, running mean, running var, eps). The float64 result of each is finite or
# infinite, never NaN.
_BEYOND_FLOAT32 = {
    # x - mean times scale overflows float32 while the low part of scale adds the other
    # infinity: inf - inf was NaN where the result is -inf.
    "low-part-overflows": ("bfloat16", [-1e20, 5.0, -3e20], -2.5e8, 1e30, -1.2e38, 1.7e-31, 1e-30),
    # scale beyond float32 (4.7e38): float32 made it inf, the outputs -inf for -2.8e34.
    "scale-beyond-float32": ("bfloat16", [1e-6, 2e-6, -3e-6], -3e38, 6e-8, -5.8e-5, 0.4, 0.0),
    # scale a float32 subnormal (1.7e-44, 4 bits): results 1% off.
    "subnormal-scale": ("bfloat16", [1e10, 2e10, -3e10], -9.8e-45, -4.27e-36, 1.0, 1 / 3, EPS),
    # scale below any float32 (3.4e-46): float32 made it 0, the outputs the bias.
    "scale-below-float32": ("float16", [-6e4, 6e4, 3e4], -1.07e-34, 1.08e-8, -3e38, 9.7e22, EPS),
    # x - mean beyond float32 (4e38): inf where the result is 2e38.
    "difference-beyond-float32": ("bfloat16", [3e38, 2.9e38, 1e38], 0.5, 0.0, -1e38, 1.0, 0.0),
}


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", sorted(_BEYOND_FLOAT32))
def test_half_inference_beyond_float32s_range_is_within_one_ulp(case, layout):
    """An F16/BF16 channel whose scale, mean or ``x - mean`` a float32 cannot hold (or holds
    in fewer bits, subnormal) gives the float64 result rounded once, within one ulp, as a
    tame channel beside it does: the float32 elementwise pass (the one-fma crossing and the
    compensated pass alike) made NaN, infinities, zeros and 1% errors of these (found by an
    outsider's differential fuzzing of extreme values)."""
    name, values, weight, bias, mean, var, eps = _BEYOND_FLOAT32[case]
    dtype = half_dtype(name)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 2, 3, 3)).astype(dtype)
    x[:, 1] = np.resize(np.array(values), (4, 3, 3)).astype(dtype)
    if layout == "NHWC":
        x = laid_out(x, channels_last(x.shape), dtype)
    w, b = np.array([0.5, weight], np.float32), np.array([0.25, bias], np.float32)
    rm, rv = np.array([0.1, mean], np.float32), np.array([2.0, var], np.float32)
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=eps)
    t = [torch.from_numpy(np.asarray(a, np.float64)) for a in (x, rm, rv, w, b)]
    with np.errstate(over="ignore"):
        want = F.batch_norm(t[0], t[1], t[2], t[3], t[4], False, 0.0, eps).numpy()
        want = (want if dtype is np.float16 else want.astype(np.float32)).astype(dtype)
    assert not np.isnan(want.astype(np.float32)).any()
    assert half_steps(y, want).max() <= 1, (np.asarray(y)[:, 1].ravel(), want[:, 1].ravel())
