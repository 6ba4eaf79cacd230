"""The one door: every array protocol becomes an ``Operand`` through ``operand``.

NumPy arrays and ``__array_interface__`` objects, CuPy arrays and ``__cuda_array_interface__``
objects, DLPack 0.x/1.0 producers and torch tensors, subclasses included, are each read by
their protocol's reader and held to the same checks (``checks.py``): element type and byte
order, sizes and strides a buffer can hold, aligned non-NULL data, torch's view bits,
read-only flags, device, and the ``Kind`` that allocates arrays like it. No other module
reads a protocol.

Devices and streams: an array's place (``place``) is found before anything is exported,
because the stream a call uses depends on it, and the protocols order the producer's work
before that stream: ``__dlpack__(stream=)`` and the CUDA array interface's ``stream``.
"""

from typing import Any

import numpy as np

from ..enums import Device, Status
from ..errors import InfiniError
from .cuda_interface import cuda_interface_device, from_cuda_interface, from_cupy, is_cupy
from .dlpack import dlpack_place, from_dlpack
from .kinds import CUPY, NUMPY, TORCH
from .numpy_arrays import from_array_interface, from_ndarray
from .operand import Operand
from .torch_tensors import from_torch, is_torch, torch_place

_DLPACK_KINDS = {Device.CPU: NUMPY, Device.NVIDIA: CUPY}


def _not_an_array(name: str, array: Any) -> InfiniError:
    return InfiniError(
        Status.BAD_PARAM,
        f"{name} must be a NumPy, CuPy or torch array, or expose __array_interface__, "
        f"__cuda_array_interface__ or __dlpack__; got {type(array).__name__}",
    )


def operand(name: str, array: Any, stream: int | None = None, *, written: bool = False) -> Operand:
    """Describe ``array`` (argument ``name``), checked; InfiniError naming ``name`` otherwise.

    ``stream`` is the CUDA stream the call uses ``array`` on (None: on the CPU, or only
    described): a DLPack producer is handed it, and it waits for a CUDA array interface
    producer's ``stream``. ``written``: the call writes ``array`` in place, so a DLPack
    producer is asked not to copy it (the operand's ``readonly`` says why any other kind of
    operand cannot be written; ``check_written`` refuses those)."""
    if isinstance(array, np.ndarray):
        return from_ndarray(name, array, NUMPY)
    if is_torch(array):
        return from_torch(name, array, TORCH)
    if is_cupy(array):
        return from_cupy(name, array, CUPY)
    if hasattr(array, "__array_interface__"):
        return from_array_interface(name, array, NUMPY)
    if hasattr(array, "__cuda_array_interface__"):
        return from_cuda_interface(name, array, stream, CUPY)
    if hasattr(array, "__dlpack__"):  # JAX, NumPy 2 and other producers
        found = from_dlpack(name, array, stream, written, _DLPACK_KINDS)
        if hasattr(array, "__dlpack_device__"):  # the place the call was planned for
            said = place(name, array)
            if said != (found.device, found.device_id):
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"{name}'s DLPack capsule is on {found.device.name}:{found.device_id} but "
                    f"its __dlpack_device__() says {said[0].name}:{said[1]}",
                )
        return found
    raise _not_an_array(name, array)


def place(name: str, array: Any) -> tuple[Device, int | None]:
    """Where ``array`` lives, found without exporting it; the device id is None for a CUDA
    array interface, whose pointer's owner only CUDA can tell (``device_of``)."""
    if isinstance(array, np.ndarray):
        return Device.CPU, 0
    if is_torch(array):
        return torch_place(name, array)
    if is_cupy(array):
        return Device.NVIDIA, array.device.id
    if hasattr(array, "__array_interface__"):
        return Device.CPU, 0
    if hasattr(array, "__cuda_array_interface__"):
        return Device.NVIDIA, None
    if hasattr(array, "__dlpack_device__"):
        found = array.__dlpack_device__()
        if not isinstance(found, tuple) or len(found) != 2:
            raise InfiniError(
                Status.BAD_PARAM,
                f"{name}.__dlpack_device__() returned {found!r}; expected (device_type, id)",
            )
        return dlpack_place(name, *found)
    if hasattr(array, "__dlpack__"):
        found = operand(name, array)
        return found.device, found.device_id
    raise _not_an_array(name, array)


def common_place(arrays: dict[str, Any]) -> tuple[Device, int]:
    """The ``(device, device_id)`` every array of ``arrays`` (by name) lives on; BAD_PARAM
    naming each array's place otherwise. Device types are compared first, so host arrays
    among device ones are refused without asking CUDA anything."""
    places = {n: place(n, a) for n, a in arrays.items()}
    if len({device for device, _ in places.values()}) == 1:
        places = {
            n: (device, cuda_interface_device(n, arrays[n]) if device_id is None else device_id)
            for n, (device, device_id) in places.items()
        }
    if len(set(places.values())) > 1:
        where = ", ".join(
            f"{n} on {device.name}" + ("" if device_id is None else f":{device_id}")
            for n, (device, device_id) in places.items()
        )
        raise InfiniError(Status.BAD_PARAM, f"arrays must share one device; got {where}")
    device, device_id = next(iter(places.values()))
    return device, device_id or 0
