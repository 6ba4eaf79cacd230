"""``InfiniError`` and one subclass per non-success ``Status``.

``InfiniError(status, message)`` returns the subclass for ``status``, so callers can raise by
status and catch by class (``except BadParamError``) or by ``.status``. Statuses with a
natural Python builtin also derive from it (BAD_PARAM and the shape/stride ones from
``ValueError``, BAD_TENSOR_DTYPE from ``TypeError``), so code written to catch those keeps
working. ``public_error`` keeps a public entry point to that contract and spells argument
names in its messages as that entry point's caller does: the array API's passes apply it in
their one call path (``api.call.run``), other entry points through the decorator
``raises_only_infini_errors``.
"""

import functools
import operator
import os
import re
import signal
import site
import sysconfig
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn, ParamSpec, TypeVar

import numpy as np

from .enums import Status

P = ParamSpec("P")
R = TypeVar("R")


class InfiniError(Exception):
    """A failed operation: ``.status`` says which ``Status``, the message says why."""

    status: Status = Status.INTERNAL_ERROR
    _by_status: ClassVar[dict[Status, type["InfiniError"]]] = {}

    def __new__(cls, status: int, message: str = "") -> "InfiniError":
        sub = InfiniError._by_status.get(Status(status), cls) if cls is InfiniError else cls
        return super().__new__(sub)

    def __init__(self, status: int, message: str = "") -> None:
        self.status = Status(status)
        super().__init__(f"{self.status.name}: {message}" if message else self.status.name)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "status" in cls.__dict__:
            InfiniError._by_status.setdefault(cls.status, cls)

    def __reduce__(self) -> tuple:
        return (type(self), (self.status, str(self).partition(": ")[2]))


class InternalError(InfiniError):
    status = Status.INTERNAL_ERROR


class NotImplementedInfiniError(InfiniError):
    status = Status.NOT_IMPLEMENTED


class BadParamError(InfiniError, ValueError):
    status = Status.BAD_PARAM


class NullPointerError(InfiniError, ValueError):
    status = Status.NULL_POINTER


class DeviceTypeNotSupportedError(InfiniError):
    status = Status.DEVICE_TYPE_NOT_SUPPORTED


class DeviceNotFoundError(InfiniError):
    status = Status.DEVICE_NOT_FOUND


class DeviceNotInitializedError(InfiniError):
    status = Status.DEVICE_NOT_INITIALIZED


class DeviceArchitectureNotSupportedError(InfiniError):
    status = Status.DEVICE_ARCHITECTURE_NOT_SUPPORTED


class BadTensorDtypeError(InfiniError, TypeError):
    status = Status.BAD_TENSOR_DTYPE


class BadTensorShapeError(InfiniError, ValueError):
    status = Status.BAD_TENSOR_SHAPE


class BadTensorStridesError(InfiniError, ValueError):
    status = Status.BAD_TENSOR_STRIDES


class InsufficientWorkspaceError(InfiniError, ValueError):
    status = Status.INSUFFICIENT_WORKSPACE


class CudnnNotFoundError(DeviceNotInitializedError):
    """libcudnn could not be loaded; the message lists every place that was searched."""


class CudnnSymbolError(NotImplementedInfiniError):
    """The loaded libcudnn does not export a function this package needs."""


def shown(value: object) -> str:
    """``value`` for a message: its repr cut short (a huge int's digits are no help)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def converted(name: str, convert: Callable[[Any], R], value: Any) -> R:
    """``convert(value)`` (``float``, ``operator.index``) for argument ``name``: the
    conversion's own TypeError (a ``__float__`` or ``__index__`` that returns another type,
    a ``numbers.Real`` registered without ``__float__``) is BAD_PARAM naming ``name``, where
    it would be an unexpected error of the package; one the caller's method raised passes."""
    try:
        return convert(value)
    except TypeError as exc:
        if raised_by_caller(exc):
            raise
        raise InfiniError(Status.BAD_PARAM, f"{name} is {shown(value)}: {exc}") from None


def integer(name: str, value: Any) -> int | None:
    """``value`` as an int where it is an integer (its type has ``__index__``: Python's,
    NumPy's) and not a bool, else None, for the caller to refuse in its own words;
    ``converted`` for the conversion itself."""
    if isinstance(value, bool | np.bool_) or not hasattr(type(value), "__index__"):
        return None
    return converted(name, operator.index, value)


def respelled(exc: InfiniError, spelling: Mapping[str, str]) -> InfiniError:
    """``exc`` with the words of its message renamed by ``spelling`` (whole words), keeping
    its class; ``exc`` itself where nothing changes."""
    if not spelling:
        return exc
    pattern = re.compile(
        r"\b(" + "|".join(sorted(map(re.escape, spelling), key=len)[::-1]) + r")\b"
    )
    message = str(exc).partition(": ")[2]
    spelled = pattern.sub(lambda m: spelling[m[0]], message)
    return exc if spelled == message else type(exc)(exc.status, spelled)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_LIBRARIES = tuple(
    {os.path.abspath(p) for p in (sysconfig.get_paths()["stdlib"], *site.getsitepackages())}
)


def raised_by_caller(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the caller's own code run inside a call (a signal
    handler, a producer's own method), or by a library that code called: from the innermost
    frame out, a signal handler's frame (the caller installed it, wherever it is defined) is
    the caller's, a library's (the standard library, site-packages, or code whose file is
    not a path: compiled modules, generated code) is passed over, and the first other frame
    decides: the main program's (a script, ``python -c``, a REPL or a notebook cell, whose
    file may be "<string>" or "<stdin>") or any file but this package's is the caller's.
    A warning raised as an exception is the caller's too: only their warnings filter
    (``python -W error``) makes one of it."""
    if isinstance(exc, Warning):
        return True
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    handlers = _signal_handlers()
    for frame in reversed(frames):
        if frame.f_code in handlers or frame.f_globals.get("__name__") == "__main__":
            return True
        filename = frame.f_code.co_filename
        if os.path.isabs(filename) and not os.path.abspath(filename).startswith(_LIBRARIES):
            return not os.path.abspath(filename).startswith(_PACKAGE)
    return False


def _signal_handlers() -> set[object]:
    """The code objects of the Python signal handlers installed now (bound methods'
    included), in the main thread, where Python runs them."""
    if threading.current_thread() is not threading.main_thread():
        return set()
    handlers = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except ValueError:  # a signal number this platform lists but will not look up
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            handlers.add(code)
    return handlers


def public_error(exc: Exception, spelling: Mapping[str, str], where: str) -> Exception:
    """What a public entry point (``where``) raises for ``exc``: an ``InfiniError`` from below
    with its message's words renamed by ``spelling`` (``respelled``: the operators' names to
    the caller's, e.g. ``"weight_desc" -> "gamma"``); an exception the caller's own code raised
    inside the call (``raised_by_caller``) unchanged; any other exception, which would be a
    bug of this package, as INTERNAL_ERROR, so callers catch one type. ``exc`` itself where
    it passes unchanged."""
    if isinstance(exc, InfiniError):
        return respelled(exc, spelling)
    if raised_by_caller(exc):
        return exc
    return InfiniError(Status.INTERNAL_ERROR, f"unexpected {type(exc).__name__} in {where}: {exc}")


def raise_public(exc: Exception, spelling: Mapping[str, str], where: str) -> NoReturn:
    """Raise what ``public_error`` says for ``exc``, the exception being handled, leaving no
    name bound to either: the traceback keeps this frame (and the caller's), and a frame
    holding its own exception is a cycle that keeps the call's arrays and plan alive until
    the garbage collector runs."""
    raised = public_error(exc, spelling, where)
    try:
        if raised is exc:
            raise
        raise raised from exc
    finally:
        exc = raised = None


def raises_only_infini_errors(
    spelling: Mapping[str, str],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a public entry point so that it raises what ``public_error`` says."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return func(*args, **kwargs)
            except Exception as exc:
                if isinstance(exc, TypeError) and exc.__traceback__.tb_next is None:
                    raise  # the arguments do not bind: Python's, as for any function
                raise_public(exc, spelling, func.__name__)

        return wrapper

    return decorate
