"""The NVIDIA path without a GPU, for the benchmarks: the tests' stand-ins, set up in one place.

Importing it puts ``tests/`` on the path (``cudnn_stub``, ``helpers`` come from there).
``stub_cudnn`` makes the stub libcudnn (``tests/cudnn_stub.py``, compiled with gcc) this
process's libcudnn, with its one-device stand-in for the CUDA seam: enough for a cached
descriptor's ``compute`` on fake pointers. ``device_arrays`` adds ``FakeCupy``
(``tests/fake_devices.py``) as ``cupy`` over the real CUDA seam, so that the array API takes
device arrays, allocates its outputs and enters its stream as it does on a GPU (as
``tests/test_streams_and_devices.py`` runs it). cuDNN returns at once and nothing is
dereferenced: what is left is this package's own host work per call, and the CuPy
stand-in's own Python (``own_share`` measures that part). Everything is undone on exit.
"""

import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import cudnn_stub  # tests/ modules, importable from here on
import helpers
from fake_devices import FakeArray, FakeCupy, FakeRawKernel, FakeStream

import cudnn_bn
from cudnn_bn.backends import cuda

__all__ = [
    "FakeCupy",
    "cudnn_stub",
    "device_arrays",
    "forget_allocations",
    "helpers",
    "own_share",
    "stub_cudnn",
]

# The CUDA seam's functions that ``cudnn_stub.install`` replaces with a one-device stand-in.
_SEAM = ("stream_scope", "current_device", "device_count")


@contextmanager
def stub_cudnn() -> Iterator[cudnn_stub.Stub]:
    """The stub libcudnn as this process's libcudnn (built in a temporary folder), no CUDA."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        yield cudnn_stub.install(cudnn_stub._compile(Path(tmp)), patch)


@contextmanager
def device_arrays() -> Iterator[FakeCupy]:
    """``stub_cudnn`` with ``FakeCupy`` as ``cupy`` (device 0, current stream 0) behind the
    real CUDA seam; yields it (``fake.array(shape)`` makes an operand)."""
    real_seam = {name: getattr(cuda, name) for name in _SEAM}
    with stub_cudnn(), pytest.MonkeyPatch.context() as patch:
        fake = FakeCupy({0: 0})
        patch.setitem(sys.modules, "cupy", fake)
        for name, function in real_seam.items():
            patch.setattr(cuda, name, function)
        patch.setattr(cuda, "_streams", {})
        cudnn_bn.descriptor_cache.clear()  # nothing built on the real library
        try:
            yield fake
        finally:
            cudnn_bn.descriptor_cache.clear()  # nothing built on the stub outlives it


def forget_allocations(fake: FakeCupy) -> None:
    """Drop the stand-in's records of the allocations so far, which grow with every call:
    a long benchmark would otherwise fill memory. Its ``pointerGetAttributes`` knows no
    address afterwards (the package reads a CuPy array's device from ``.device``)."""
    fake.log.clear()
    fake.owners.clear()


def own_share(fake: FakeCupy, call: Callable[[], object], calls: int) -> float:
    """The fraction of ``calls`` runs of ``call`` spent inside the CuPy stand-in (its arrays'
    CUDA array interface, views and copies, allocation, streams, device calls, kernel
    launches, copies from the host), timed round its entry points (outermost entry only):
    the part of a device-array call that a real CuPy replaces with its own. A fraction of
    the same runs, so that a pause of the process scales both; the timing wrappers' own cost
    (``_wrapper_cost``, per outermost entry) is taken out of both the time inside and the
    whole, which it would otherwise bias towards the package (it runs outside the timed
    span, yet is no part of a real call)."""
    spent, depth, entries = [0.0], [0], [0]

    def timed(function: Callable) -> Callable:
        def wrapper(*args: object, **kwargs: object) -> object:
            depth[0] += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += time.perf_counter() - start
                    entries[0] += 1

        return wrapper

    inside, whole = _wrapper_cost(timed, spent)
    interface = FakeArray.__dict__["__cuda_array_interface__"]
    runtime = fake.cuda.runtime
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FakeArray, "__cuda_array_interface__", property(timed(interface.fget)))
        for name in ("transpose", "swapaxes", "reshape", "__setitem__"):
            patch.setattr(FakeArray, name, timed(getattr(FakeArray, name)))
        for name in ("empty", "ascontiguousarray"):
            patch.setattr(fake, name, timed(getattr(fake, name)))
        for name in ("__enter__", "__exit__"):
            patch.setattr(FakeStream, name, timed(getattr(FakeStream, name)))
        patch.setattr(fake.cuda, "get_current_stream", timed(fake.cuda.get_current_stream))
        patch.setattr(FakeRawKernel, "__call__", timed(FakeRawKernel.__call__))
        for name in ("getDevice", "setDevice", "memcpyAsync"):
            patch.setattr(runtime, name, timed(getattr(runtime, name)))
        _forget_plans()
        call()  # plans made again, with the timed functions; not timed
        spent[0], entries[0] = 0.0, 0
        start = time.perf_counter()
        for _ in range(calls):
            call()
        total = time.perf_counter() - start
    _forget_plans()
    own = max(spent[0] - entries[0] * inside, 0.0)
    return own / max(total - entries[0] * whole, own, 1e-12)


def _wrapper_cost(timed: Callable, spent: list[float], runs: int = 20000) -> tuple[float, float]:
    """``(inside, whole)``: seconds a ``timed`` wrapper adds per call of a function that does
    nothing, within its timed span and in all (medians of 5 runs of ``runs`` calls)."""

    def nothing() -> None:
        return None

    wrapped = timed(nothing)
    insides, wholes = [], []
    for _ in range(5):
        spent[0] = 0.0
        start = time.perf_counter()
        for _ in range(runs):
            wrapped()
        middle = time.perf_counter()
        for _ in range(runs):
            nothing()
        end = time.perf_counter()
        insides.append(spent[0] / runs)
        wholes.append(((middle - start) - (end - middle)) / runs)
    spent[0] = 0.0
    return statistics.median(insides), statistics.median(wholes)


def _forget_plans() -> None:
    """Forget the array API's plans: they keep the CuPy functions they were made with
    (``cupy.empty`` bound to each output's layout, a batched plan's gather kernel), so
    ``own_share`` times calls of plans made with its timed functions, and the calls after it
    plans made without."""
    cudnn_bn.descriptor_cache.clear()
