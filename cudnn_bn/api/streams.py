"""The CUDA stream an array-API call runs on, and the scope its allocations need."""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..arrays import common_place
from ..arrays.kinds import CUPY, TORCH
from ..arrays.torch_tensors import is_torch
from ..enums import Device, Status
from ..errors import InfiniError, integer, shown

_ON_HOST = nullcontext()
_ABSENT = object()


def resolve_stream(stream: Any, like: Any) -> int:
    """The ``cudaStream_t`` address a call on ``like``'s device runs on for ``stream=``
    (0 on the CPU), as every array-API pass resolves it: for code that composes passes."""
    device, device_id = common_place({"input": like})
    return call_stream(stream, like, device, device_id)


def call_stream(stream: Any, like: Any, device: Device, device_id: int) -> int:
    """A ``cudaStream_t`` address from an int, a CuPy or torch stream, a ``__cuda_stream__``
    object, or the current stream of the arrays' device (torch's for torch tensors, else
    CuPy's); 0 on the CPU, where a ``stream=`` given must still be one of those."""
    if device == Device.CPU:
        if stream is not None:
            host_stream(stream)
        return 0
    if stream is None:
        return (TORCH if is_torch(like) else CUPY).current(like, device_id)[0]
    return given_stream(stream, device_id)


def call_place(
    stream: Any, like: Any, kind: Any, device: Device, device_id: int
) -> tuple[int, AbstractContextManager]:
    """``(stream, scope)`` of a call whose input ``like`` is of ``kind`` (``arrays.kinds``):
    ``call_stream``'s stream, and the scope in which ``kind`` allocates on it (entering
    nothing where its device and stream are current already)."""
    if device == Device.CPU:
        return 0, _ON_HOST
    if stream is None:
        return kind.current(like, device_id)
    ptr = given_stream(stream, device_id)
    return ptr, kind.scope(like, ptr, device_id)


def host_stream(stream: Any) -> None:
    """Check a ``stream=`` given with host arrays, which run on none (code written for both
    may pass one): what ``given_stream`` takes, on any device."""
    given_stream(stream, None)


@dataclass(frozen=True, slots=True)
class GivenStream:
    """A ``stream=`` object as ``read_stream`` read it, once: its address, and the device it
    says it belongs to (None: it says none), so that a stream object whose answers change
    cannot have the checks see one stream and the launch use another."""

    ptr: int
    owner: int | None


def read_stream(stream: Any) -> Any:
    """``stream=`` with any stream object read (``GivenStream``): None, an int and one
    already read are themselves (an int subclass its value); BAD_PARAM where it is none of
    the forms ``given_stream`` takes."""
    if stream is None or type(stream) is int or type(stream) is GivenStream:
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _address(stream, stream)
    protocol = getattr(stream, "__cuda_stream__", _ABSENT)  # (version 0, address)
    if protocol is not _ABSENT:
        pair = protocol()
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InfiniError(
                Status.BAD_PARAM,
                f"stream.__cuda_stream__() returned {shown(pair)}, not (version, address)",
            )
        ptr = pair[1]
    else:  # CuPy's streams have .ptr, torch's .cuda_stream
        ptr = getattr(stream, "ptr", _ABSENT)
        ptr = getattr(stream, "cuda_stream", _ABSENT) if ptr is _ABSENT else ptr
        if ptr is _ABSENT:
            raise InfiniError(
                Status.BAD_PARAM,
                f"stream must be an int, a CuPy or torch stream, or None; got {stream!r}",
            )
    ptr = _address(stream, ptr)
    # CuPy streams know their device as .device_id (-1: unknown), torch's as .device.
    owner = getattr(stream, "device_id", _ABSENT)
    if owner is _ABSENT:
        owner = getattr(getattr(stream, "device", None), "index", None)
    return GivenStream(ptr, owner if isinstance(owner, int) and owner >= 0 else None)


def given_stream(stream: Any, device_id: int | None) -> int:
    """The ``cudaStream_t`` address of a ``stream=`` the caller gave (``read_stream``
    reads it where it is not read yet), which must not belong to a device other than
    ``device_id`` (None: any)."""
    if type(stream) is int:
        return _address(stream, stream)
    given = read_stream(stream)
    if type(given) is int:
        return given
    if device_id is not None and given.owner is not None and given.owner != device_id:
        raise InfiniError(
            Status.BAD_PARAM,
            f"stream is on device {given.owner} but the arrays are on NVIDIA:{device_id}",
        )
    return given.ptr


def _address(stream: Any, ptr: Any) -> int:
    """``ptr``, the address of ``stream`` (the stream itself, or a stream object's), as a
    ``cudaStream_t``: an integer from 0 to 2**64 - 1 (a bool, a float or None is none)."""
    number = integer("stream", ptr)
    if number is None:
        raise InfiniError(
            Status.BAD_PARAM, f"stream {shown(stream)} has address {shown(ptr)}, not an int"
        )
    if not 0 <= number < 1 << 64:
        what = f"stream {number}" if ptr is stream else f"stream {shown(stream)}'s address {number}"
        raise InfiniError(Status.BAD_PARAM, f"{what} is not a cudaStream_t (0 to 2**64 - 1)")
    return number
