"""Finding and loading libcudnn: the wheel, fake library trees, CUDNN_PATH, a missing library.

The loader's state is process-wide (one load per process, failures remembered), so every
case that needs a particular search outcome runs in a fresh Python subprocess.
"""

import ctypes.util
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cudnn_bn
from cudnn_bn._cudnn import loader
from cudnn_bn.errors import CudnnNotFoundError

REPO = Path(cudnn_bn.__file__).resolve().parents[1]

# Runs in the subprocess: rebind sys.path as configured, then ask for cudnn_info() twice.
CHILD = r"""
import json, sys
config = json.loads(sys.argv[1])
sys.path = config["prefix"] + [config["replace"].get(p, p) for p in sys.path]
import cudnn_bn
from cudnn_bn.errors import CudnnNotFoundError
results = []
for _ in range(2):
    try:
        info = cudnn_bn.cudnn_info()
    except CudnnNotFoundError as exc:
        results.append({"error": type(exc).__name__, "status": exc.status, "message": str(exc)})
    else:
        results.append({"path": info.path, "found_via": info.found_via, "version": info.version})
print(json.dumps(results))
"""


def run_child(code: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("CUDNN_PATH", "LD_LIBRARY_PATH")}
    environ["PYTHONPATH"] = str(REPO)
    environ.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def load_in_child(tmp_path: Path, *, prefix=(), hide_wheel=False, env=None) -> list[dict]:
    """``cudnn_info()`` twice in a fresh process; each result is its info or its error."""
    replace = hidden_wheel_path(tmp_path / "site") if hide_wheel else {}
    config = json.dumps({"prefix": [str(p) for p in prefix], "replace": replace})
    return json.loads(run_child(CHILD, config, cwd=tmp_path, env=env))


def hidden_wheel_path(root: Path) -> dict[str, str]:
    """For each sys.path entry holding ``nvidia/cudnn``, a copy of it (symlinks) without
    ``nvidia``: {entry: copy}."""
    replace = {}
    for index, entry in enumerate(sys.path):
        if not entry or not (Path(entry) / "nvidia" / "cudnn").is_dir():
            continue
        copy = root / str(index)
        copy.mkdir(parents=True)
        for item in Path(entry).iterdir():
            if item.name != "nvidia":
                (copy / item.name).symlink_to(item)
        replace[entry] = str(copy)
    return replace


def build_library(path: Path, source: str) -> Path:
    """Compile ``source`` into the shared library ``path``."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    path.parent.mkdir(parents=True, exist_ok=True)
    c_file = path.with_suffix(".c")
    c_file.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(c_file)], check=True)
    return path


def fake_cudnn(path: Path, version: int, cudart: int = 12080) -> Path:
    source = (
        "#include <stddef.h>\n"
        f"size_t cudnnGetVersion(void) {{ return {version}; }}\n"
        f"size_t cudnnGetCudartVersion(void) {{ return {cudart}; }}\n"
    )
    return build_library(path, source)


@pytest.fixture
def no_system_cudnn():
    if ctypes.util.find_library("cudnn"):
        pytest.skip("the system's dynamic loader finds a libcudnn, so it cannot be hidden")


def test_cudnn_info_reports_the_wheel_version():
    info = cudnn_bn.cudnn_info()
    version_h = Path(info.path).resolve().parents[1] / "include" / "cudnn_version.h"
    if not version_h.is_file():
        pytest.skip(f"no cudnn_version.h beside {info.path}")
    pattern = r"#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) (\d+)"
    defines = dict(re.findall(pattern, version_h.read_text()))
    major, minor, patch = (int(defines[k]) for k in ("MAJOR", "MINOR", "PATCHLEVEL"))
    assert info.version == major * 10000 + minor * 100 + patch
    assert info.version_string == f"{major}.{minor}.{patch}"


def test_fresh_process_finds_the_wheel(tmp_path):
    [info, again] = load_in_child(tmp_path)
    assert info == again
    assert info["found_via"] == "wheel", info
    assert Path(info["path"]).match("nvidia/cudnn/lib/libcudnn.so.*")
    assert Path(info["path"]).is_file()


def test_candidates_order():
    found = list(loader.candidates({"CUDNN_PATH": "/opt/cudnn"}, ["/site", "/later"]))
    already = [c for c in found if c[0] == "already loaded"]
    assert found[: len(already)] == already, "already-loaded copies come first"
    rest = found[len(already) :]
    kinds = [kind for kind, _ in rest]
    assert kinds == sorted(kinds, key=["wheel", "CUDNN_PATH", "system"].index)
    wheel = [path for kind, path in rest if kind == "wheel"]
    assert wheel[0] == "/site/nvidia/cudnn/lib/libcudnn.so.9"
    assert wheel.index("/site/nvidia/cudnn/lib/libcudnn.so.9") < wheel.index(
        "/later/nvidia/cudnn/lib/libcudnn.so.9"
    ), "sys.path order"
    assert ("CUDNN_PATH", "/opt/cudnn/lib/libcudnn.so.9") in rest
    assert rest[-1][0] == "system"
    assert ("system", "libcudnn.so.9") in rest


def test_candidates_without_cudnn_path():
    found = list(loader.candidates({}, ["/site"]))
    assert "CUDNN_PATH" not in {kind for kind, _ in found}


def test_candidates_default_to_sys_path_and_environ_at_the_call(monkeypatch):
    monkeypatch.setattr(sys, "path", ["/rebound"])  # a new list, not the one seen at import
    monkeypatch.setenv("CUDNN_PATH", "/opt/cudnn")
    found = list(loader.candidates())
    assert ("wheel", "/rebound/nvidia/cudnn/lib/libcudnn.so.9") in found
    assert ("CUDNN_PATH", "/opt/cudnn/lib/libcudnn.so.9") in found


def test_fake_wheel_first_on_sys_path(tmp_path):
    lib = fake_cudnn(tmp_path / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9", 90123)
    [info, _] = load_in_child(tmp_path, prefix=[tmp_path])
    assert info == {"path": str(lib.resolve()), "found_via": "wheel", "version": 90123}


def test_candidates_skip_the_working_directory():
    found = list(loader.candidates({}, ["", ".", "site-packages", "/site"]))
    wheel = [path for kind, path in found if kind == "wheel"]
    assert wheel and all(path.startswith("/site/") for path in wheel)


def test_a_libcudnn_in_the_working_directory_is_not_loaded(tmp_path):
    """``python -c``/``python script.py`` put the working directory ("" or the script's
    folder) on sys.path: a ``nvidia/cudnn/lib`` lying there must not hijack the load."""
    fake_cudnn(tmp_path / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9", 90999)
    [info, _] = load_in_child(tmp_path, prefix=["", "."])
    assert info.get("version") != 90999, info
    assert not info.get("path", "").startswith(str(tmp_path)), info


def test_already_loaded_prefers_the_wanted_major(tmp_path):
    """Two cuDNN majors mapped (another library loaded cuDNN 8 first): cuDNN 9 is taken,
    also under a versioned file name (a system install's libcudnn.so.9.1.0)."""
    old = fake_cudnn(tmp_path / "a" / "libcudnn.so.8", 8907)
    new = fake_cudnn(tmp_path / "b" / "libcudnn.so.9.1.0", 90100, cudart=13000)
    code = (
        "import ctypes, json, sys\n"
        "ctypes.CDLL(sys.argv[1]); ctypes.CDLL(sys.argv[2])\n"
        "import cudnn_bn\n"
        "info = cudnn_bn.cudnn_info()\n"
        "print(json.dumps([info.path, info.found_via, info.version, info.cudart_version]))\n"
    )
    result = json.loads(run_child(code, str(old), str(new), cwd=tmp_path))
    assert result == [str(new), "already loaded", 90100, 13000]


def test_cudnn_info_reports_both_cuda_runtimes():
    info = cudnn_bn.cudnn_info()
    assert info.cudart_version >= 11000  # the wheel's cuDNN was built for CUDA 11 or later
    if importlib.util.find_spec("cupy") is not None:
        assert info.cupy_cudart_version >= 11000
    assert loader.cuda_version_string(12080) == "12.8"


def test_without_libcudnn_the_nvidia_backend_falls_back_to_cupy(monkeypatch):
    """libcudnn cannot load but CuPy can run: the CuPy engine serves, with a warning."""
    from cudnn_bn._cudnn import library
    from cudnn_bn.backends import cuda

    missing = CudnnNotFoundError(cudnn_bn.Status.DEVICE_NOT_INITIALIZED, "no libcudnn here")
    monkeypatch.setattr(library, "_library", None)
    monkeypatch.setattr(loader, "_loaded", None)
    monkeypatch.setattr(loader, "_failure", missing)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    x = cudnn_bn.TensorDesc.contiguous(cudnn_bn.DataType.F32, (2, 3, 4, 5))
    c = cudnn_bn.TensorDesc.contiguous(cudnn_bn.DataType.F32, (3,))
    handle = cudnn_bn.Handle(cudnn_bn.Device.NVIDIA, 0)
    with pytest.warns(RuntimeWarning, match="runs on CuPy kernels instead: .*no libcudnn here"):
        desc = cudnn_bn.BatchNormBackwardDescriptor(handle, x, c, c, x, x, c, c, c)
    with desc:
        assert desc.engine == "cupy"


def test_cudnn_path(tmp_path, no_system_cudnn):
    lib = fake_cudnn(tmp_path / "root" / "lib" / "libcudnn.so.9", 90201)
    [info, _] = load_in_child(tmp_path, hide_wheel=True, env={"CUDNN_PATH": str(tmp_path / "root")})
    assert info == {"path": str(lib.resolve()), "found_via": "CUDNN_PATH", "version": 90201}


def test_missing_library_raises_at_first_use_every_time(tmp_path, no_system_cudnn):
    first, second = load_in_child(tmp_path, hide_wheel=True)
    assert first["error"] == second["error"] == "CudnnNotFoundError"
    assert first["status"] == second["status"] == cudnn_bn.Status.DEVICE_NOT_INITIALIZED
    for place in ("already loaded", "wheel: nvidia/cudnn/lib", "CUDNN_PATH: (not set)", "system"):
        assert place in first["message"]
    assert "pip install 'cudnn_bn[cuda12]'" in first["message"]  # the extra that brings it
    assert first["message"] == second["message"]


def test_library_that_is_not_cudnn(tmp_path, no_system_cudnn):
    lib = tmp_path / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
    build_library(lib, "int not_cudnn(void) { return 0; }\n")
    [result, _] = load_in_child(tmp_path, prefix=[tmp_path], hide_wheel=True)
    assert result["error"] == "CudnnNotFoundError"
    assert f"{lib}: not a cuDNN library" in result["message"]


def test_import_loads_nothing(tmp_path):
    # Nor numba: the CPU engine's kernels load with its first call (the cold-start figure
    # counts the import apart; a GPU user never needs them).
    code = (
        "import json, sys\n"
        "import cudnn_bn\n"
        "maps = open('/proc/self/maps').read()\n"
        "heavy = sorted(m for m in sys.modules\n"
        "               if m.split('.')[0] in ('cupy', 'cupyx', 'torch', 'numba', 'llvmlite'))\n"
        "print(json.dumps({'libcudnn': 'libcudnn' in maps, 'modules': heavy}))\n"
    )
    assert json.loads(run_child(code, cwd=tmp_path)) == {"libcudnn": False, "modules": []}
