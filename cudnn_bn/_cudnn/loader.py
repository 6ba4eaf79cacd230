"""Finding and loading ``libcudnn``, once per process.

Search order: a copy already loaded in the process (PyTorch loads its own; cuDNN 9 before
cuDNN 8 when several are mapped), the ``nvidia-cudnn-cu12``/``-cu13`` wheel
(``nvidia/cudnn/lib`` under each absolute ``sys.path`` entry), ``$CUDNN_PATH``, then the
system's dynamic loader. The empty and relative ``sys.path`` entries (the working directory
when running from a source tree) are skipped: a ``nvidia/cudnn/lib/libcudnn.so.9`` lying in
whatever folder the program runs from must not be loaded ahead of the real one. Importing
the package never loads anything; the first call that needs cuDNN does, and a failure is
stored and raised again, listing every place tried.
"""

import ctypes
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..enums import Status
from ..errors import CudnnNotFoundError

SONAMES = ("libcudnn.so.9", "libcudnn.so.8")  # the wanted major first
# The extras of pyproject.toml that bring CuPy, the cuDNN wheel and cuda-python.
INSTALL_HINT = "pip install 'cudnn_bn[cuda12]' (or 'cudnn_bn[cuda13]' for CUDA 13)"
_MAPPED = re.compile(r"libcudnn\.so\.(\d+)(\.|$)")  # libcudnn.so.9, libcudnn.so.9.1.0


def cuda_version_string(version: int) -> str:
    """A CUDA runtime version (``major * 1000 + minor * 10``) as ``major.minor``."""
    return f"{version // 1000}.{version % 1000 // 10}"


@dataclass(frozen=True)
class CudnnInfo:
    """Which libcudnn was loaded, from where, and its version (``cudnnGetVersion``);
    ``cudart_version`` is the CUDA runtime it was built for (``cudnnGetCudartVersion``),
    ``cupy_cudart_version`` the one CuPy runs on (None without CuPy): their majors must
    match for cuDNN to run on CuPy's memory and streams."""

    path: str
    found_via: str
    version: int
    cudart_version: int = 0
    cupy_cudart_version: int | None = None

    @property
    def version_string(self) -> str:
        major, minor, patch = self.version // 10000, self.version // 100 % 100, self.version % 100
        if major == 0:  # cuDNN 8 encodes versions as major*1000 + minor*100 + patch.
            major, minor = self.version // 1000, self.version // 100 % 10
        return f"{major}.{minor}.{patch}"


def _already_loaded() -> Iterator[str]:
    """The libcudnn files mapped into this process, the wanted major version first."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return
    majors = [soname.rsplit(".", 1)[1] for soname in SONAMES]
    found: dict[str, str] = {}
    for line in lines:
        path = line.split(maxsplit=5)[-1]
        if (match := _MAPPED.match(os.path.basename(path))) and match[1] in majors:
            found.setdefault(path, match[1])
    yield from sorted(found, key=lambda path: majors.index(found[path]))


def candidates(
    environ: Mapping[str, str] | None = None, search_path: Sequence[str] | None = None
) -> Iterator[tuple[str, str]]:
    """``(found_via, path)`` pairs in search order; ``path`` may not exist.

    ``environ`` and ``search_path`` default to ``os.environ`` and ``sys.path`` as they are
    at the call (``sys.path`` may have been rebound since import).
    """
    environ = os.environ if environ is None else environ
    search_path = sys.path if search_path is None else search_path
    for path in _already_loaded():
        yield "already loaded", path
    for entry in search_path:
        if not os.path.isabs(entry):  # "" and relative entries: the working directory
            continue
        for soname in SONAMES:
            yield "wheel", os.path.join(entry, "nvidia", "cudnn", "lib", soname)
    if root := environ.get("CUDNN_PATH"):
        for sub in ("lib", "lib64", ""):
            for soname in SONAMES:
                yield "CUDNN_PATH", os.path.join(root, sub, soname)
    for soname in SONAMES:
        yield "system", soname


def _try_load(path: str) -> tuple[ctypes.CDLL, int, int]:
    """The library at ``path``, its ``cudnnGetVersion`` and ``cudnnGetCudartVersion``."""
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "cudnnGetVersion"):
        raise OSError("not a cuDNN library: no cudnnGetVersion")
    return lib, _size_t_call(lib, "cudnnGetVersion"), _size_t_call(lib, "cudnnGetCudartVersion")


def _size_t_call(lib: ctypes.CDLL, name: str) -> int:
    """``size_t name(void)`` of ``lib``; 0 where ``lib`` has no such function."""
    function = getattr(lib, name, None)
    if function is None:
        return 0
    function.restype, function.argtypes = ctypes.c_size_t, []
    return int(function())


def find_and_load(
    environ: Mapping[str, str] | None = None, search_path: Sequence[str] | None = None
) -> tuple[ctypes.CDLL, CudnnInfo]:
    """Load the first libcudnn in search order, or raise ``CudnnNotFoundError`` listing all."""
    environ = os.environ if environ is None else environ
    search_path = sys.path if search_path is None else search_path
    tried = []
    for found_via, path in candidates(environ, search_path):
        is_file = os.path.sep in path
        if is_file and not os.path.exists(path):
            continue
        try:
            lib, version, cudart = _try_load(path)
        except OSError as exc:
            tried.append(f"  {found_via}: {path}: {exc}")
            continue
        info = CudnnInfo(_resolved(lib, path), found_via, version, cudart_version=cudart)
        return lib, info
    places = [
        "  already loaded in this process: none",
        f"  wheel: nvidia/cudnn/lib/{{{','.join(SONAMES)}}} under each absolute sys.path "
        f"entry ({sum(os.path.isabs(e) for e in search_path)}; the working directory is not "
        "searched)",
        f"  CUDNN_PATH: {environ.get('CUDNN_PATH', '(not set)')}",
        "  system: the dynamic loader's search path (LD_LIBRARY_PATH, ldconfig)",
    ]
    raise CudnnNotFoundError(
        Status.DEVICE_NOT_INITIALIZED,
        "libcudnn could not be loaded. Looked in:\n"
        + "\n".join(places)
        + ("\nFound but failed to load:\n" + "\n".join(tried) if tried else "")
        + f"\nInstall it with {INSTALL_HINT}, or set CUDNN_PATH.",
    )


def _resolved(lib: ctypes.CDLL, path: str) -> str:
    """The file the dynamic loader actually opened (a bare soname names no file)."""
    if os.path.sep in path:
        return os.path.realpath(path)
    return next(_already_loaded(), path)


_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL, CudnnInfo] | None = None
_failure: CudnnNotFoundError | None = None


def load() -> tuple[ctypes.CDLL, CudnnInfo]:
    """The process-wide libcudnn and its ``CudnnInfo``; a failure is remembered and re-raised."""
    global _loaded, _failure
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = find_and_load()
            except CudnnNotFoundError as exc:
                _failure = exc
        if _failure is not None:
            raise CudnnNotFoundError(_failure.status, str(_failure).partition(": ")[2])
        return _loaded
