"""Shared test set-up: the ``gpu`` marker's one skip, and the GPU report.

Tests marked ``gpu`` are skipped, with the reason, where there is no usable GPU: CuPy or a
CUDA build of torch missing, or CUDA reporting no device. When they did run and
``CUDNN_BN_GPU_REPORT`` names a file, a short Markdown report is written there at the end of
the session (``make test-gpu``).
"""

import ctypes
import functools
import os
import platform
import shutil
import sys
from pathlib import Path

import pytest

REPORT_ENV = "CUDNN_BN_GPU_REPORT"


@functools.cache
def gpu_unavailable() -> str | None:
    """Why the ``gpu`` tests cannot run here, or None when they can; the first thing missing,
    said plainly (a machine with no driver has no GPU, whatever CUDA's error code says)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA GPU: the NVIDIA driver (libcuda.so.1) is not installed"
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc}): pip install 'cudnn_bn[cuda12]' or '[cuda13]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError, or a missing CUDA library
        return f"no usable CUDA GPU: {type(exc).__name__}: {exc}"
    if count == 0:
        return "no CUDA GPU: the driver reports no device"
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed ({exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} is not a CUDA build or sees no device"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and (reason := gpu_unavailable()):
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)


# --- the GPU report ------------------------------------------------------------------------

_gpu_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if "gpu" not in report.keywords or (report.when != "call" and report.passed):
        return
    if report.when == "call":
        outcome = f"passed ({report.duration:.2f} s)" if report.passed else report.outcome
    else:  # skipped by the marker, or an error in a fixture
        outcome = f"{report.outcome} in {report.when}"
    _gpu_outcomes.setdefault(report.nodeid, outcome)


def _safe(describe) -> str:
    try:
        return describe()
    except Exception as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"


def _cuda_version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"


def _environment() -> list[str]:
    import cupy
    import torch

    import cudnn_bn

    runtime = cupy.cuda.runtime

    def device() -> str:
        props = runtime.getDeviceProperties(0)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return f"{name} (compute capability {props['major']}.{props['minor']})"

    def cudnn() -> str:
        info = cudnn_bn.cudnn_info()
        return f"{info.version_string} ({info.version}), {info.path}, found via {info.found_via}"

    return [
        f"- device: {_safe(device)}",
        f"- CUDA driver {_safe(lambda: _cuda_version(runtime.driverGetVersion()))}, "
        f"runtime {_safe(lambda: _cuda_version(runtime.runtimeGetVersion()))}",
        f"- cuDNN: {_safe(cudnn)}",
        f"- CuPy {cupy.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"Python {platform.python_version()}",
    ]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    ran = [o for o in _gpu_outcomes.values() if not o.startswith("skipped")]
    if not path or not ran:
        return
    counts: dict[str, int] = {}
    for outcome in _gpu_outcomes.values():
        word = outcome.split()[0]
        counts[word] = counts.get(word, 0) + 1
    lines = [
        "# cudnn_bn GPU tests",
        "",
        *_safe(lambda: "\n".join(_environment())).splitlines(),
        f"- outcomes: {', '.join(f'{n} {word}' for word, n in sorted(counts.items()))}",
        "",
        "| test | outcome |",
        "|---|---|",
        *(f"| `{nodeid}` | {outcome} |" for nodeid, outcome in _gpu_outcomes.items()),
        "",
    ]
    report = Path(path)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines))


# --- the stub libcudnn of the NVIDIA-argument tests (``cudnn_stub.py``) ---------------------


@pytest.fixture(scope="module")
def stub_path(tmp_path_factory):
    """The stub libcudnn, compiled once per session (skips where there is no gcc)."""
    from cudnn_stub import build

    return build(tmp_path_factory)


@pytest.fixture
def stub(stub_path, monkeypatch):
    """The stub as this process's libcudnn for one test, its records reset."""
    from cudnn_stub import install

    return install(stub_path, monkeypatch)


# --- CuPy's kernels on the host (``cupy_on_host.py``) ----------------------------------------


@pytest.fixture(scope="session")
def host_cupy_module(tmp_path_factory):
    """The stand-in ``cupy`` module, its kernels compiled once per session."""
    pytest.importorskip("cupy", reason="real CuPy parses the kernels' parameter lists")
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to compile the kernels for the host")
    from cupy_on_host import module

    return module(tmp_path_factory.mktemp("cupy_on_host"))


def _forget_built_kernels() -> None:
    """Drop the descriptors and kernels built with whichever ``cupy`` was in place."""
    import cudnn_bn
    from cudnn_bn.backends import cupy_kernels, cupy_reductions

    cudnn_bn.descriptor_cache.clear()
    for module in (cupy_kernels, cupy_reductions):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


@pytest.fixture
def host_cupy(host_cupy_module, monkeypatch):
    """The stand-in as ``cupy`` for one test; nothing built with it outlives the test."""
    from cudnn_bn.backends import cuda

    monkeypatch.setitem(sys.modules, "cupy", host_cupy_module)
    monkeypatch.setattr(cuda, "_streams", {})
    _forget_built_kernels()
    yield host_cupy_module
    _forget_built_kernels()
