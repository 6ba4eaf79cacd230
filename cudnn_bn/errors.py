"""``InfiniError`` and one subclass per non-success ``Status``.

``InfiniError(status, message)`` returns the subclass for ``status``, so callers can raise by
status and catch by class (``except BadParamError``) or by ``.status``.
"""

from typing import ClassVar

from .enums import Status


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
