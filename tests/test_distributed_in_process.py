"""Synchronized batch norm's parts in one process: the statistics' combination, the ranks'
agreement, the adapters' choice, the CuPy kernel of the elementwise pass (on the host), and
the CuPy NCCL adapter against a recording stand-in for ``cupy.cuda.nccl.NcclCommunicator``
whose ranks are threads.
"""

import contextlib
import ctypes
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import random_values

import cudnn_bn
from cudnn_bn import InfiniError, Status
from cudnn_bn.backends import cuda as cuda_backend
from cudnn_bn.distributed import arguments as arguments_module
from cudnn_bn.distributed import sync_batch_norm_backward, sync_batch_norm_forward_training
from cudnn_bn.distributed.agreement import check_agreement, combine, header
from cudnn_bn.distributed.communicators import NCCL_FLOAT64, NCCL_SUM, communicator
from cudnn_bn.distributed.kinds import NumpyKind, cupy_grad_input_kernel, cupy_normalize_kernel
from cudnn_bn.enums import Device

# --- the combination of per-rank statistics ---------------------------------------------------


def _pieces(x: np.ndarray, sizes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-piece (count, mean, M2) of ``x``'s rows cut into ``sizes``, one column per channel."""
    cuts = np.split(x, np.cumsum(sizes)[:-1])
    n = np.array([len(c) for c in cuts], dtype=float)
    mean = np.array([c.mean(axis=0) if len(c) else np.zeros(x.shape[1]) for c in cuts])
    m2 = np.array([((c - c.mean(axis=0)) ** 2).sum(axis=0) if len(c) else 0 * x[0] for c in cuts])
    return n, mean, m2


@pytest.mark.parametrize("sizes", [[7], [3, 4], [5, 0, 2], [0, 6, 1, 3, 2], [1, 1, 1, 1, 1, 1, 1]])
def test_combined_statistics_are_those_of_the_whole_batch(sizes):
    x = np.random.default_rng(1).standard_normal((sum(sizes), 3)) * 3 + 1
    n, mean, m2 = combine(*_pieces(x, sizes))
    assert n == sum(sizes)
    np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-14)
    np.testing.assert_allclose(m2 / n, x.var(axis=0), rtol=1e-13)


def test_combination_keeps_the_variance_of_data_far_from_zero():
    """Values around 1e9 with unit spread: ``E[x^2] - E[x]^2`` from per-rank sums of squares
    loses every digit (1e18 against 1); Chan's update keeps it to 1e-7."""
    x = 1e9 + np.random.default_rng(2).standard_normal((4000, 2))
    n, _, m2 = combine(*_pieces(x, [1000, 1500, 0, 1500]))
    np.testing.assert_allclose(m2 / n, x.var(axis=0), rtol=1e-7)


# --- agreement ---------------------------------------------------------------------------------


def _headers(*rows: np.ndarray) -> np.ndarray:
    return np.vstack(rows)


def test_agreeing_ranks_give_the_global_count():
    same = [header(0, count, (count, 3, 5), 14, (1e-5, 0.1)) for count in (4, 0, 9)]
    assert check_agreement(_headers(*same), "op", "eps and momentum") == 13


@pytest.mark.parametrize(
    ("other", "status", "words"),
    [
        (header(0, 2, (2, 4, 5), 14, (1e-5, 0.1)), Status.BAD_TENSOR_SHAPE, "(N, 4, 5) F64"),
        (header(0, 2, (2, 3, 5, 1), 14, (1e-5, 0.1)), Status.BAD_TENSOR_SHAPE, "(N, 3, 5, 1)"),
        (header(0, 2, (2, 3, 5), 13, (1e-5, 0.1)), Status.BAD_TENSOR_DTYPE, "(N, 3, 5) F32"),
        (header(0, 2, (2, 3, 5), 14, (1e-3, 0.1)), Status.BAD_PARAM, "eps and momentum"),
        (header(Status.BAD_TENSOR_STRIDES), Status.BAD_TENSOR_STRIDES, "failed on rank 1"),
    ],
)
def test_disagreement_names_every_rank(other, status, words):
    mine = header(0, 2, (2, 3, 5), 14, (1e-5, 0.1))
    with pytest.raises(InfiniError) as info:
        check_agreement(_headers(mine, other), "op", "eps and momentum")
    assert info.value.status == status
    assert words in str(info.value)


# --- adapters and kinds ------------------------------------------------------------------------


def test_a_group_of_no_known_engine_is_refused():
    x = np.ones((4, 2))
    with pytest.raises(InfiniError, match="group must be an mpi4py communicator") as info:
        sync_batch_norm_forward_training(x, x[0], x[0], None, None, group=object())
    assert info.value.status == Status.BAD_PARAM


def test_arrays_of_no_known_kind_are_refused_on_every_rank(staging_cupy):
    world, ones = World(1), np.ones(1)
    with pytest.raises(InfiniError, match="input must be a NumPy") as info:
        sync_batch_norm_forward_training([[1.0]], ones, ones, None, None, group=world.comm(0))
    assert info.value.status == Status.BAD_PARAM


KERNELS = {  # the CuPy kernel, its data arguments and per-channel terms, the NumPy pass
    "normalize": (cupy_normalize_kernel, 1, 3, lambda k, data, terms: k.normalize(*data, terms)),
    "grad_input": (
        cupy_grad_input_kernel,
        2,
        4,
        lambda k, data, terms: k.grad_input(*data, terms),
    ),
}


@pytest.mark.parametrize("pass_name", list(KERNELS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_cupy_kernels_compute_the_numpy_passes(pass_name, dtype, host_cupy):
    """The CuPy kernels' C++, run on the host (``cupy_on_host.py``), against the NumPy
    passes: both in float64, rounded once to the data's dtype."""
    kernel, data_count, term_count, numpy_pass = KERNELS[pass_name]
    kernel.cache_clear()
    rng = np.random.default_rng(4)
    data = [rng.standard_normal((3, 4, 5)).astype(dtype) for _ in range(data_count)]
    terms = tuple(rng.standard_normal(4) for _ in range(term_count))
    out = np.empty_like(data[0])
    try:
        kernel()(*data, *(t.reshape(1, 4, 1) for t in terms), out)
    finally:
        kernel.cache_clear()
    expected = numpy_pass(NumpyKind(), data, terms)
    ulp = np.finfo(dtype).eps  # one rounding apart at most (the C++ compiler may fuse)
    np.testing.assert_allclose(out, expected, rtol=ulp, atol=ulp)


# --- CuPy's NCCL communicator, recorded ------------------------------------------------------


class World:
    """``size`` ranks as threads, exchanging through shared slots between barriers."""

    def __init__(self, size: int, fail: str | None = None, devices: list[int] | None = None):
        self.size, self.fail, self.devices = size, fail, devices or [0] * size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int, values: np.ndarray) -> list[np.ndarray]:
        self.slots[rank] = values.copy()
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone

    def comm(self, rank: int) -> "RecordingNccl":
        return RecordingNccl(self, rank)


def _doubles(address: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_double * count).from_address(address))


class RecordingNccl:
    """Stands in for ``cupy.cuda.nccl.NcclCommunicator``: its method names and argument
    orders, "device" buffers at host addresses, and a record of every call."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank, self.calls = world, rank, []
        self.devices: list[int] = []  # the current device at each collective

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world.size

    def device_id(self) -> int:
        return self.world.devices[self.rank]

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int):
        self.calls.append(("allGather", count, datatype, None, stream))
        self.devices.append(sys.modules["cupy"].current_device())
        if self.world.fail == "allGather":
            raise sys.modules["cupy.cuda.nccl"].NcclError("NCCL_ERROR_UNHANDLED_CUDA_ERROR")
        parts = self.world.exchange(self.rank, _doubles(sendbuf, count))
        _doubles(recvbuf, count * self.world.size)[:] = np.concatenate(parts)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream):
        self.calls.append(("allReduce", count, datatype, op, stream))
        self.devices.append(sys.modules["cupy"].current_device())
        parts = self.world.exchange(self.rank, _doubles(sendbuf, count))
        _doubles(recvbuf, count)[:] = np.sum(parts, axis=0)


class _DeviceBuffer(np.ndarray):
    """Host memory that answers ``.data.ptr`` as a CuPy array does."""

    @property
    def data(self) -> Any:
        return types.SimpleNamespace(ptr=self.ctypes.data)


CURRENT_STREAM = 0x5EED


@pytest.fixture
def staging_cupy(monkeypatch):
    """A ``cupy`` with just the staging calls the NCCL adapter makes, on host memory, a
    current device per thread (as CUDA's), and a ``cupy.cuda.nccl`` with just its error class
    (not a RuntimeError, so that only catching CuPy's own class turns it into InfiniError).
    The host arrays stand for arrays on ``fake.place`` (NVIDIA:0 unless a test moves them),
    on the given stream or the current one."""
    current = threading.local()
    fake = types.ModuleType("cupy")
    fake.asarray = lambda values: np.array(values, np.float64).view(_DeviceBuffer)
    fake.empty = lambda shape, dtype: np.zeros(shape, dtype).view(_DeviceBuffer)
    fake.asnumpy = lambda array: np.array(array)
    fake.current_device = lambda: getattr(current, "device", 0)
    fake.cuda = types.SimpleNamespace(
        get_current_stream=lambda device=None: types.SimpleNamespace(ptr=CURRENT_STREAM),
        ExternalStream=lambda ptr, device_id=-1: contextlib.nullcontext(),
        Stream=types.SimpleNamespace(null=contextlib.nullcontext()),
        runtime=types.SimpleNamespace(
            getDevice=fake.current_device,
            setDevice=lambda device: setattr(current, "device", device),
            CUDARuntimeError=RuntimeError,
        ),
    )
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.NcclError = type("NcclError", (Exception,), {})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    monkeypatch.setattr(cuda_backend, "_streams", {})
    fake.place = {}  # "rank-<r>" (its thread's name) -> the device of its arrays
    monkeypatch.setattr(
        arguments_module,
        "common_place",
        lambda arrays: (Device.NVIDIA, fake.place.get(threading.current_thread().name, 0)),
    )
    monkeypatch.setattr(
        arguments_module,
        "resolve_stream",
        lambda stream, like: CURRENT_STREAM if stream is None else stream,
    )
    return fake


def on_ranks(world: World, work: Callable[[int, Any], Any]) -> list[Any]:
    """``work(rank, group)`` on every rank of ``world`` at once; results (or errors) by rank."""
    results: list[Any] = [None] * world.size

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank, world.comm(rank))
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


SIZES = [3, 0, 5]  # an empty rank among uneven ones


def _global_problem() -> tuple[dict[str, np.ndarray], list[int]]:
    return random_values((sum(SIZES), 4, 5), seed=5, bias=True), [0, *np.cumsum(SIZES)]


def test_nccl_adapter_passes_equal_single_process_batch_norm(staging_cupy):
    v, cuts = _global_problem()
    stream = 0xBEEF

    def work(rank: int, group: RecordingNccl) -> Any:
        x, dy = (v[n][cuts[rank] : cuts[rank + 1]] for n in ("input", "grad_output"))
        rm, rv = v["running_mean"].copy(), v["running_var"].copy()
        forward = sync_batch_norm_forward_training(
            x, v["weight"], v["bias"], rm, rv, group=group, stream=stream
        )
        backward = sync_batch_norm_backward(x, dy, v["weight"], *forward[1:], group=group)
        return forward, backward, rm, rv, group.calls

    results = on_ranks(World(len(SIZES)), work)
    rm, rv = v["running_mean"].copy(), v["running_var"].copy()
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(
        v["input"], v["weight"], v["bias"], rm, rv
    )
    grad_input = cudnn_bn.batch_norm_backward(
        v["input"], v["grad_output"], v["weight"], None, None,
        mode="saved", saved_mean=mean, saved_invstd=invstd,
    )[0]  # fmt: skip
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result
        (y_r, mean_r, invstd_r), (grad_input_r, *_), rm_r, rv_r, calls = result
        piece = slice(cuts[rank], cuts[rank + 1])
        for got, want in (
            (y_r, y[piece]),
            (mean_r, mean),
            (invstd_r, invstd),
            (rm_r, rm),
            (rv_r, rv),
        ):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grad_input_r, grad_input[piece], rtol=1e-12, atol=1e-12)
        assert calls == [
            ("allGather", 10, NCCL_FLOAT64, None, stream),  # header, on the caller's stream
            ("allGather", 2 * 4, NCCL_FLOAT64, None, stream),  # mean and M2
            ("allGather", 10, NCCL_FLOAT64, None, CURRENT_STREAM),  # header, current stream
            ("allReduce", 2 * 4, NCCL_FLOAT64, NCCL_SUM, CURRENT_STREAM),  # the two sums
        ]


def test_a_constant_channel_with_eps_0_has_torchs_invstd_0_on_every_rank(staging_cupy):
    """The global statistics take torch's ``InvStd``, as one process's do: a channel of 0
    variance with eps 0 has invstd 0, its output the bias, its grad_input 0 (the formula's
    1/sqrt(0) gave inf and NaN)."""
    v, cuts = _global_problem()
    v["input"][:, 1] = 3.25

    def work(rank: int, group: RecordingNccl) -> Any:
        x, dy = (v[n][cuts[rank] : cuts[rank + 1]] for n in ("input", "grad_output"))
        forward = sync_batch_norm_forward_training(
            x, v["weight"], v["bias"], None, None, group=group, eps=0.0
        )
        return forward, sync_batch_norm_backward(x, dy, v["weight"], *forward[1:], group=group)

    want = torch.ops.aten.native_batch_norm(
        *(torch.from_numpy(v[n]) for n in ("input", "weight", "bias")), None, None, True, 0.1, 0.0
    )
    for rank, result in enumerate(on_ranks(World(len(SIZES)), work)):
        assert not isinstance(result, Exception), result
        (y, _, invstd), (grad_input, grad_weight, _) = result
        assert invstd[1] == want[2][1] == 0
        np.testing.assert_allclose(y, want[0][cuts[rank] : cuts[rank + 1]], rtol=1e-12, atol=1e-12)
        assert (grad_input[:, 1] == 0).all() and grad_weight[1] == 0


def test_an_nccl_failure_raises_with_its_message_and_writes_nothing(staging_cupy):
    v, cuts = _global_problem()
    kept = []

    def work(rank: int, group: RecordingNccl) -> Any:
        x = v["input"][cuts[rank] : cuts[rank + 1]]
        rm = v["running_mean"].copy()
        kept.append(rm)
        return sync_batch_norm_forward_training(x, v["weight"], v["bias"], rm, None, group=group)

    for result in on_ranks(World(len(SIZES), fail="allGather"), work):
        assert isinstance(result, InfiniError) and result.status == Status.INTERNAL_ERROR, result
        assert "NCCL allGather failed: NCCL_ERROR_UNHANDLED_CUDA_ERROR" in str(result)
    assert all(np.array_equal(rm, v["running_mean"]) for rm in kept)


def test_groups_go_to_their_adapters(staging_cupy):
    assert communicator(World(2).comm(1), lambda: 0).engine == "NCCL"
    assert communicator(World(2).comm(1), lambda: 0).rank == 1


def test_half_sums_are_taken_in_float32(staging_cupy):
    """F16 data with an F16 weight: ``sum(dy)`` over 70000 values of 1 is past F16's largest
    finite value (65504); reduced in F16 it would be inf and grad_input NaN."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((70000, 1)).astype(np.float16)
    dy = np.ones_like(x)
    w, b = np.ones(1, np.float16), np.zeros(1, np.float16)
    group = World(1).comm(0)
    _, mean, invstd = sync_batch_norm_forward_training(x, w, b, None, None, group=group)
    grad_input, _, grad_bias = sync_batch_norm_backward(x, dy, w, mean, invstd, group=group)
    assert np.isfinite(grad_input).all()
    assert np.abs(grad_input.astype(float)).max() < 1e-2  # a constant dy has no gradient
    assert grad_bias.dtype == np.float16 and np.isinf(grad_bias)  # the caller's dtype: 70000


def test_a_bad_input_on_a_rank_with_one_value_per_channel_raises_on_every_rank(staging_cupy):
    """Rank 0 has one value per channel, so no statistics of its own to compute, and its
    input has a negative stride: it is refused before the first collective, on every rank,
    and no rank writes (issue 16 #8: rank 1 used to succeed and write)."""
    v = random_values((6, 4), seed=8, bias=True)
    kept = []

    def work(rank: int, group: RecordingNccl) -> Any:
        x = v["input"][:1, ::-1] if rank == 0 else v["input"][1:]
        rm = v["running_mean"].copy()
        kept.append(rm)
        return sync_batch_norm_forward_training(x, v["weight"], v["bias"], rm, None, group=group)

    results = on_ranks(World(2), work)
    for rank, result in enumerate(results):
        assert isinstance(result, InfiniError), (rank, result)
        assert result.status == Status.BAD_TENSOR_STRIDES, result
    assert "input has negative strides" in str(results[0])
    assert "failed on rank 0" in str(results[1])
    assert all(np.array_equal(rm, v["running_mean"]) for rm in kept)


def test_grad_output_of_another_kind_on_one_rank_raises_on_every_rank(staging_cupy):
    v = random_values((6, 4), seed=9, bias=True)
    mean, invstd = v["input"].mean(axis=0), np.ones(4)

    def work(rank: int, group: RecordingNccl) -> Any:
        dy = torch.from_numpy(v["grad_output"]) if rank == 1 else v["grad_output"]
        return sync_batch_norm_backward(v["input"], dy, v["weight"], mean, invstd, group=group)

    results = on_ranks(World(2), work)
    assert all(isinstance(r, InfiniError) and r.status == Status.BAD_PARAM for r in results)
    assert "grad_output is a Tensor but input is a ndarray" in str(results[1])


def test_nccl_collectives_run_on_the_communicators_device(staging_cupy):
    """Each rank's collectives are queued with its communicator's device current (issue 19
    #5), whichever device was current before."""
    v, cuts = _global_problem()
    staging_cupy.place.update({"rank-1": 1, "rank-2": 2})

    def work(rank: int, group: RecordingNccl) -> Any:
        x, dy = (v[n][cuts[rank] : cuts[rank + 1]] for n in ("input", "grad_output"))
        _, mean, invstd = sync_batch_norm_forward_training(
            x, v["weight"], v["bias"], None, None, group=group
        )
        sync_batch_norm_backward(x, dy, v["weight"], mean, invstd, group=group)
        return group.devices

    for rank, devices in enumerate(on_ranks(World(3, devices=[0, 1, 2]), work)):
        assert devices == [rank] * 4, (rank, devices)


def test_arrays_off_the_communicators_device_are_refused_on_every_rank(staging_cupy):
    """Rank 1's arrays are on device 0 but its communicator is on device 1: refused before
    any collective but the header, on every rank (issue 19 #5: NCCL would read the wrong
    device's memory)."""
    v, cuts = _global_problem()

    def work(rank: int, group: RecordingNccl) -> Any:
        x = v["input"][cuts[rank] : cuts[rank + 1]]
        try:
            return sync_batch_norm_forward_training(
                x, v["weight"], v["bias"], None, None, group=group
            )
        finally:
            assert [c[:2] for c in group.calls] == [("allGather", 10)], group.calls

    results = on_ranks(World(3, devices=[0, 1, 0]), work)
    assert all(isinstance(r, InfiniError) and r.status == Status.BAD_PARAM for r in results)
    assert "arrays are on NVIDIA:0 but the NCCL communicator's device is NVIDIA:1" in str(
        results[1]
    )
    assert "failed on rank 1" in str(results[0])
