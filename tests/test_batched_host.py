"""How ``batch_norm_backward_batched`` runs on the CPU engine (``api/batched_pass.py``):
one launch over the caller's arrays, in place for problems of ``MIN_VALUES`` or more, else
folded by one gather; never a copy by NumPy, never a second trip through the array API.
Counted on the launches of backward descriptors, the kernel's batch and gather calls and
NumPy's packed copies; results bit for bit those of each problem alone."""

import sys

import numpy as np
import pytest
from helpers import assert_close
from test_batched import arguments, problem, torch_batched, weight_of

import cudnn_bn
from cudnn_bn import BatchNormBackwardDescriptor, batch_norm_backward, batch_norm_backward_batched
from cudnn_bn.backends import cpu_kernels, cpu_pool


def assert_each_problem_alone(p: dict, got: tuple) -> None:
    """``got`` is, bit for bit, what ``batch_norm_backward`` gives each problem alone."""
    for i in range(p["input"].shape[0]):
        one = batch_norm_backward(p["input"][i], p["grad_output"][i], weight_of(p, i), None, None)
        for batched_result, single in zip(got, one, strict=True):
            np.testing.assert_array_equal(batched_result[i], single)


@pytest.fixture
def launches(monkeypatch) -> dict[str, list]:
    """What a call launches and copies: each launch of a backward descriptor (one problem's
    input shape, problems per launch), each ``cpu_kernels.batch_pass`` (its table of blocks
    of problems), each ``cpu_kernels.gather`` (its operands), each packed copy of a NumPy
    array the package makes; from an empty plan cache."""
    cudnn_bn.descriptor_cache.clear()
    seen: dict[str, list] = {"launches": [], "batch_pass": [], "gathers": [], "copies": []}
    launcher = BatchNormBackwardDescriptor.launcher

    def counting(self, *args, **kwargs):
        launch = launcher(self, *args, **kwargs)
        problems = (kwargs.get("batch") or (1,))[0]
        record = lambda *_: (self.tensors.input.shape, problems)  # noqa: E731
        return launch._replace(call=counted("launches", record, launch.call))

    def counted(kind, record, function):
        def wrapper(*args):
            seen[kind].append(record(*args))
            return function(*args)

        return wrapper

    monkeypatch.setattr(BatchNormBackwardDescriptor, "launcher", counting)
    blocks = lambda *args: tuple(map(tuple, args[6].tolist()))  # noqa: E731
    monkeypatch.setattr(
        cpu_kernels, "batch_pass", counted("batch_pass", blocks, cpu_kernels.batch_pass)
    )
    monkeypatch.setattr(cpu_kernels, "gather", counted("gathers", len, cpu_kernels.gather))
    packed = np.ascontiguousarray

    def copied(array, *args, **kwargs):  # by the package: none of the tests' own
        if "/cudnn_bn/" in sys._getframe(1).f_code.co_filename:
            seen["copies"].append(np.shape(array))
        return packed(array, *args, **kwargs)

    monkeypatch.setattr(np, "ascontiguousarray", copied)
    return seen


@pytest.mark.parametrize("threads", [1, 2])
def test_problems_of_many_values_run_in_place_in_one_launch(launches, threads, monkeypatch):
    """Issue 17: ``(B, N, C, ...)`` data folds into ``(N, B*C, ...)`` by no view, and copying
    it in and out cost more than the pass (64 problems ``(4, 64, 7, 7)``: 2.35x one call of
    the same size). A problem of ``MIN_VALUES`` or more runs where it lies: one launch of one
    problem's plan over the whole batch, no copy; with threads, blocks of problems."""
    monkeypatch.setattr(cpu_pool, "_count", threads)
    p = problem((8, 4, 16, 16, 8), np.float32, np.float32, "batched")  # 8 x 8192 values
    got = batch_norm_backward_batched(*arguments(p, "train"))
    assert launches["launches"] == [((4, 16, 16, 8), 8)]
    assert launches["copies"] == launches["gathers"] == []
    # Each thread's call claims from one table of blocks of problems (``cpu_pool.team``).
    assert set(launches["batch_pass"]) == {((0, 8),) if threads == 1 else ((0, 4), (4, 8))}
    assert_each_problem_alone(p, got)
    for actual, expected in zip(got, torch_batched(p, "train"), strict=True):
        assert_close(actual, expected, np.float32)


def test_problems_too_large_for_one_call_each_run_one_launch_each(launches):
    """A problem that is threaded itself (no one-call pass) runs as one launch per problem,
    still over the caller's arrays."""
    p = problem((2, 2, 16, 64, 32), np.float32, np.float32, "shared")  # 65536 values each
    got = batch_norm_backward_batched(*arguments(p, "train"))
    assert launches["launches"] == [((2, 16, 64, 32), 2)]
    assert launches["copies"] == launches["batch_pass"] == launches["gathers"] == []
    assert_each_problem_alone(p, got)


def test_small_problems_fold_by_one_gather_into_one_launch(launches):
    """Issue 17: the fold copied input and grad_output by NumPy and the per-channel operands
    by assignment, then ran the whole array API again on the copies (64 problems ``(8, 4)``:
    2.07x one call of that size). Now one kernel call gathers every operand (here input,
    grad_output and the shared weight) and the folded problem runs in one launch."""
    p = problem((5, 4, 3, 6), np.float32, np.float32, "shared")
    got = batch_norm_backward_batched(*arguments(p, "train"))
    assert launches["launches"] == [((4, 15, 6), 1)]
    assert launches["gathers"] == [3]
    assert launches["copies"] == launches["batch_pass"] == []
    assert_each_problem_alone(p, got)


@pytest.mark.parametrize("shape", [(6, 3, 4, 5), (6, 4, 16, 16, 8)], ids=["folded", "in place"])
def test_calls_from_many_threads_at_once(shape):
    """One plan run by several Python threads at once: each call gathers into scratch of
    its own (folded) or reads the caller's arrays (in place), so each gets its own result."""
    from concurrent.futures import ThreadPoolExecutor

    problems = [problem(shape, np.float32, np.float32, "batched", seed=s) for s in range(4)]
    want = [batch_norm_backward_batched(*arguments(p, "train")) for p in problems]
    with ThreadPoolExecutor(4) as pool:
        runs = [
            pool.submit(batch_norm_backward_batched, *arguments(p, "train")) for p in problems * 5
        ]
        got = [run.result() for run in runs]
    for i, results in enumerate(got):
        for actual, expected in zip(results, want[i % 4], strict=True):
            np.testing.assert_array_equal(actual, expected)
