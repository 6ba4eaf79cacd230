"""The one door: every array protocol becomes an ``Operand`` through ``operand``.

NumPy arrays and ``__array_interface__`` objects, CuPy arrays and ``__cuda_array_interface__``
objects, DLPack 0.x/1.0 producers and torch tensors, subclasses included, are each read by
their protocol's reader and held to the same checks (``checks.py``): element type and byte
order, sizes and strides a buffer can hold, aligned non-NULL data, torch's view bits,
read-only flags, device, and the ``Kind`` that allocates arrays like it. No other module
reads a protocol.

Each protocol is read once per operand and call (``see``): its presence is found on the
type and the instance ``__dict__`` without evaluating it, an interface's dict is taken as one
snapshot (``checks.snapshot``), and the one value read serves the place, the device, the
description and the pointer, so a producer whose interface says
something else on another read (an attacker's, or one racing a writer) cannot have one read
checked and another used. Callers that find a place first hand ``common_place`` and
``operand`` the same ``Seen``.

Devices and streams: an array's place (``place``) is found before anything is exported,
because the stream a call uses depends on it, and the protocols order the producer's work
before that stream: ``__dlpack__(stream=)`` and the CUDA array interface's ``stream``.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..enums import Device, Status
from ..errors import InfiniError
from .checks import snapshot
from .cuda_interface import (
    cuda_interface_device,
    cupy_attributes,
    from_cuda_interface,
    from_cupy,
    is_cupy,
)
from .dlpack import dlpack_place, from_dlpack
from .kinds import CUPY, NUMPY, TORCH
from .numpy_arrays import from_array_interface, from_ndarray
from .operand import Operand
from .torch_tensors import from_torch, is_torch, torch_place

_DLPACK_KINDS = {Device.CPU: NUMPY, Device.NVIDIA: CUPY}
_ABSENT = object()
_MRO = type.__dict__["__mro__"].__get__  # a class's own, whatever its metaclass says
_CLASS_DICT = type.__dict__["__dict__"].__get__


@dataclass(slots=True)
class Seen:
    """One array as the door first sees it (``see``): the protocol it is read by (None for
    an ndarray, a torch tensor or a CuPy array, read from their attributes), that protocol's
    value, read once (an interface's dict, or the ``__dlpack__`` method), and its place;
    ``device_id`` is None for a CUDA array interface until ``common_place`` asks CUDA which
    device owns its pointer. ``said``: what told a DLPack producer's place. ``export``: for
    a DLPack producer without ``__dlpack_device__``, the operand of the export that told its
    place (asked ``copy=False`` where ``written``), which ``operand`` takes where it hands
    the producer no stream, so that one export places and describes it."""

    array: Any
    protocol: str | None
    value: Any
    device: Device
    device_id: int | None
    said: str = ""
    export: Operand | None = None
    written: bool = False


def _not_an_array(name: str, array: Any) -> InfiniError:
    return InfiniError(
        Status.BAD_PARAM,
        f"{name} must be a NumPy, CuPy or torch array, or expose __array_interface__, "
        f"__cuda_array_interface__ or __dlpack__; got {type(array).__name__}",
    )


def _namespaces(array: Any) -> list | None:
    """Where ``array``'s attributes may be found without evaluating any: its type's classes'
    dicts (object's aside) and its instance ``__dict__``; None where its type computes
    attributes (``__getattr__``, its own ``__getattribute__``), which must be read to be
    found."""
    spaces = []
    for k in _MRO(type(array))[:-1]:  # object has no protocol
        names = _CLASS_DICT(k)
        if "__getattr__" in names or "__getattribute__" in names:
            return None
        spaces.append(names)
    try:
        own = object.__getattribute__(array, "__dict__")
    except AttributeError:
        own = None
    if type(own) is dict:
        spaces.append(own)
    return spaces


def _attribute(array: Any, name: str, spaces: list | None) -> Any:
    """``array.<name>`` read once, or ``_ABSENT`` where none of ``spaces``
    (``_namespaces``; None: unknown) holds it or its read raises AttributeError (as for
    ``hasattr``)."""
    if spaces is not None:
        for names in spaces:
            if name in names:
                break
        else:
            return _ABSENT
    try:
        return getattr(array, name)
    except AttributeError:
        return _ABSENT


def _attribute_place(name: str, array: Any) -> tuple[Device, int] | None:
    """The place of an ndarray, a torch tensor or a CuPy array, from its attributes (None
    for any other object)."""
    if isinstance(array, np.ndarray):
        return Device.CPU, 0
    if is_torch(array):
        return torch_place(name, array)
    if is_cupy(array):
        return Device.NVIDIA, cupy_attributes(array, "device")[0].id
    return None


def see(name: str, array: Any, *, written: bool = False) -> Seen:
    """``array`` (argument ``name``) as the door sees it, each protocol read at most once;
    BAD_PARAM where it has none. ``written``: as for ``operand``, for a DLPack producer
    that only an export can place."""
    where = _attribute_place(name, array)
    if where is not None:
        return Seen(array, None, None, *where)
    spaces = _namespaces(array)
    for protocol, device, device_id in (
        ("__array_interface__", Device.CPU, 0),
        ("__cuda_array_interface__", Device.NVIDIA, None),
    ):
        value = _attribute(array, protocol, spaces)
        if value is not _ABSENT:
            return Seen(array, protocol, snapshot(value), device, device_id)
    said = _attribute(array, "__dlpack_device__", spaces)
    if said is not _ABSENT:
        found = said()
        if not isinstance(found, tuple) or len(found) != 2:
            raise InfiniError(
                Status.BAD_PARAM,
                f"{name}.__dlpack_device__() returned {found!r}; expected (device_type, id)",
            )
        device, device_id = dlpack_place(name, *found)
        export = _attribute(array, "__dlpack__", spaces)  # _ABSENT: refused by ``operand``
        return Seen(array, "__dlpack__", export, device, device_id, "its __dlpack_device__() says")
    export = _attribute(array, "__dlpack__", spaces)
    if export is _ABSENT:
        raise _not_an_array(name, array)
    found = from_dlpack(name, export, None, written, _DLPACK_KINDS)  # its place: an export
    return Seen(array, "__dlpack__", export, found.device, found.device_id,
                "an export of it without the call's stream was", found, written)  # fmt: skip


def operand(name: str, array: Any, stream: int | None = None, *, written: bool = False) -> Operand:
    """Describe ``array`` (argument ``name``; or the ``Seen`` of it), checked; InfiniError
    naming ``name`` otherwise.

    ``stream`` is the CUDA stream the call uses ``array`` on (None: on the CPU, or only
    described): a DLPack producer is handed it, and it waits for a CUDA array interface
    producer's ``stream``. ``written``: the call writes ``array`` in place, so a DLPack
    producer is asked not to copy it (the operand's ``readonly`` says why any other kind of
    operand cannot be written; ``check_written`` refuses those)."""
    seen = array if isinstance(array, Seen) else None
    if seen is None or seen.protocol is None:  # no protocol read yet, or none to read
        array = array if seen is None else seen.array
        if isinstance(array, np.ndarray):
            return from_ndarray(name, array, NUMPY)
        if is_torch(array):
            return from_torch(name, array, TORCH)
        if is_cupy(array):
            return from_cupy(name, array, CUPY)
        seen = see(name, array, written=written)
    array = seen.array
    if seen.protocol == "__array_interface__":
        return from_array_interface(name, array, seen.value, NUMPY)
    if seen.protocol == "__cuda_array_interface__":
        return from_cuda_interface(name, array, seen.value, seen.device_id, stream, CUPY)
    if seen.value is _ABSENT:  # a __dlpack_device__ without __dlpack__
        raise _not_an_array(name, array)
    if seen.export is not None and stream is None and seen.written == written:
        return seen.export  # exported as it would be again
    found = from_dlpack(name, seen.value, stream, written, _DLPACK_KINDS)
    if (found.device, found.device_id) != (seen.device, seen.device_id):  # planned for
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}'s DLPack capsule is on {found.device.name}:{found.device_id} but "
            f"{seen.said} {seen.device.name}:{seen.device_id}",
        )
    return found


def place(name: str, array: Any) -> tuple[Device, int | None]:
    """Where ``array`` lives, found without exporting it; the device id is None for a CUDA
    array interface, whose pointer's owner only CUDA can tell (``common_place``)."""
    seen = array if isinstance(array, Seen) else _attribute_place(name, array) or see(name, array)
    return (seen.device, seen.device_id) if isinstance(seen, Seen) else seen


def common_place(arrays: dict[str, Any]) -> tuple[Device, int]:
    """The ``(device, device_id)`` every array of ``arrays`` (by name; arrays or their
    ``Seen``, whose CUDA array interfaces get their owning device) lives on; BAD_PARAM
    naming each array's place otherwise. Device types are compared first, so host arrays
    among device ones are refused without asking CUDA anything."""
    seen = {
        n: a if isinstance(a, Seen) else _attribute_place(n, a) or see(n, a)
        for n, a in arrays.items()
    }
    places = {n: (s.device, s.device_id) if isinstance(s, Seen) else s for n, s in seen.items()}
    if len({device for device, _ in places.values()}) == 1:
        for n, s in seen.items():
            if isinstance(s, Seen) and s.device_id is None:
                s.device_id = cuda_interface_device(n, s.value)
                places[n] = s.device, s.device_id
    if len(set(places.values())) > 1:
        where = ", ".join(
            f"{n} on {device.name}" + ("" if device_id is None else f":{device_id}")
            for n, (device, device_id) in places.items()
        )
        raise InfiniError(Status.BAD_PARAM, f"arrays must share one device; got {where}")
    device, device_id = next(iter(places.values()))
    return device, device_id or 0
