"""The loaded libcudnn with the prototype table applied lazily, and the one status checker.

``cudnn()`` returns the process-wide ``CudnnLibrary``; its attributes are the functions of
``PROTOTYPES``, bound on first use. A function the library does not export becomes a stub
that raises ``CudnnSymbolError`` when called, so an older cuDNN still serves everything else.
Every ``cudnnStatus_t`` result goes through ``_check``, which raises ``InfiniError`` with the
mapped status and cuDNN's own error strings. ``CUDNN_BN_LOG_API_ARGS=1`` logs every call.
"""

import ctypes
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from ..enums import Status
from ..errors import CudnnNotFoundError, CudnnSymbolError, InfiniError
from .loader import CudnnInfo, load
from .prototypes import PROTOTYPES, cudnnStatus_t
from .status import cudnn_status_to_infini

_LAST_ERROR_BYTES = 1024


class CudnnLibrary:
    """libcudnn's functions of ``PROTOTYPES`` as attributes, bound on first use."""

    def __init__(self, cdll: ctypes.CDLL, info: CudnnInfo) -> None:
        self._cdll = cdll
        self.info = info
        self._log = os.environ.get("CUDNN_BN_LOG_API_ARGS", "") not in ("", "0")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in PROTOTYPES:
            raise AttributeError(f"{name} is not in the cuDNN prototype table")
        restype, argtypes = PROTOTYPES[name]
        try:
            func = getattr(self._cdll, name)
        except AttributeError:
            func = _absent(name, self.info)
        else:
            func.restype, func.argtypes = restype, list(argtypes)
            if restype is cudnnStatus_t:
                func.errcheck = self._check
            if self._log:
                func = _logged(name, func)
        setattr(self, name, func)
        return func

    def last_error(self) -> str:
        """``cudnnGetLastErrorString``: cuDNN's detail on the last failure in this thread."""
        buffer = ctypes.create_string_buffer(_LAST_ERROR_BYTES)
        try:
            self.cudnnGetLastErrorString(buffer, _LAST_ERROR_BYTES)
        except CudnnSymbolError:
            return ""
        return buffer.value.decode(errors="replace").strip()

    def _check(self, result: int, func: Any, args: tuple) -> int:
        if result != 0:
            raise error_from_status(self, result, func.__name__)
        return result


def error_from_status(lib: CudnnLibrary, code: int, func_name: str) -> InfiniError:
    """An ``InfiniError`` for a failed cuDNN call, with cuDNN's error and last-error strings."""
    name = lib.cudnnGetErrorString(code).decode(errors="replace")
    message = f"{func_name} returned {name} ({code})"
    if detail := lib.last_error():
        message += f": {detail}"
    return InfiniError(cudnn_status_to_infini(code), message)


def _absent(name: str, info: CudnnInfo) -> Callable[..., Any]:
    def absent(*args: Any) -> Any:
        raise CudnnSymbolError(
            Status.NOT_IMPLEMENTED,
            f"{name} is not exported by cuDNN {info.version_string} at {info.path}",
        )

    absent.__name__ = name
    return absent


def _shown(arg: Any) -> str:
    """An argument as the call log shows it: ctypes arrays (dims, strides) by their values."""
    return repr(list(arg)) if isinstance(arg, ctypes.Array) else repr(arg)


def _logged(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def logged(*args: Any) -> Any:
        print(f"cudnn_bn: {name}({', '.join(map(_shown, args))})", file=sys.stderr)
        return func(*args)

    logged.__name__ = name
    return logged


_library: CudnnLibrary | None = None


def cudnn() -> CudnnLibrary:
    """The process-wide ``CudnnLibrary``; raises ``CudnnNotFoundError`` if none can load."""
    global _library
    if _library is None:
        _library = CudnnLibrary(*load())
    return _library


def cudnn_info() -> CudnnInfo:
    """Which libcudnn this process uses: ``path``, ``found_via``, ``version``, the CUDA
    runtime it was built for (``cudart_version``) and CuPy's (``cupy_cudart_version``)."""
    return dataclasses.replace(cudnn().info, cupy_cudart_version=_cupy_cudart_version())


def _cupy_cudart_version() -> int | None:
    """``cudaRuntimeGetVersion`` of the runtime CuPy uses (None without CuPy)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:  # no CuPy, or a CuPy that cannot start: nothing to report
        return None


def cudnn_loads() -> bool:
    """Whether libcudnn loads. When it does not, the NVIDIA backend runs every problem on
    its CuPy engine, saying so with a warning (once per place that asks) rather than
    failing."""
    try:
        cudnn()
    except CudnnNotFoundError as exc:
        warnings.warn(
            f"cuDNN is unavailable, batch norm runs on CuPy kernels instead: {exc}",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True
