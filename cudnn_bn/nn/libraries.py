"""The array libraries a layer keeps its state in (NumPy, CuPy, torch): which one an array
belongs to, on which device, and new arrays there from host values.

A layer's parameters and statistics live in its input's library and on its device; they
are made from, and read back into, host NumPy values only when created, saved or loaded.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from ..enums import Status
from ..errors import InfiniError, raised_by_caller

_NOT_REAL = "cOSUmM"  # NumPy's kinds of complex, object, string, date and duration dtypes


def library(name: str, array: Any) -> str:
    """``"numpy"``, ``"cupy"`` or ``"torch"``; BAD_PARAM for anything else."""
    if isinstance(array, np.ndarray):
        return "numpy"
    package = type(array).__module__.partition(".")[0]
    if package in ("cupy", "torch") and hasattr(array, "shape"):
        return package
    raise InfiniError(
        Status.BAD_PARAM,
        f"{name} must be a NumPy or CuPy array or a torch tensor, got {type(array).__name__}",
    )


def place(name: str, array: Any) -> tuple[str, str]:
    """(library, device) of ``array``, e.g. ``("torch", "cuda:1")`` or ``("numpy", "cpu")``."""
    lib = library(name, array)
    if lib == "numpy":
        return lib, "cpu"
    if lib == "cupy":
        return lib, f"cuda:{array.device.id}"
    return lib, str(array.device)


def new(values: np.ndarray, where: tuple[str, str], dtype: str) -> Any:
    """``values`` as a new array at ``where`` (``place``'s (library, device)), of dtype
    ``dtype`` (a NumPy dtype name: ``"float32"``, ``"float64"``, ``"int64"``)."""
    lib, device = where
    if lib == "numpy":
        with np.errstate(over="ignore"):  # beyond float32: inf, as torch's copies make it
            return np.array(values, dtype=dtype)
    if lib == "cupy":
        import cupy

        with cupy.cuda.Device(int(device.removeprefix("cuda:"))):
            return cupy.array(values, dtype=dtype)
    import torch

    return torch.tensor(values, dtype=getattr(torch, dtype), device=device)


def host(name: str, array: Any, integers: bool = False) -> np.ndarray:
    """A float64 NumPy copy of an array of any of the three libraries, or of a number, of
    real numbers (bool, integer or float, ml_dtypes' too): anything else is BAD_PARAM, as
    torch's load refuses it, where NumPy would drop imaginary parts (with a warning), read
    None as NaN or parse strings; so is a tensor torch cannot copy to host values (meta,
    quantized, nested: a RuntimeError) and a masked array (its masked values would be read,
    as the array API refuses them). An exception the caller's own method raises passes.
    ``integers``: integer values come back as int64, exactly (a count beyond 2**53, as
    torch's int64 holds it)."""
    if isinstance(array, np.ma.MaskedArray):  # np.asarray would drop its mask
        raise InfiniError(Status.BAD_PARAM, f"{name} is a masked array; masked arrays are refused")
    try:
        lib = type(array).__module__.partition(".")[0]
        if lib == "torch":
            values = array.detach().to("cpu", copy=True)
            if not values.is_complex():
                exact = integers and not values.is_floating_point()
                return (values.long() if exact else values.double()).numpy()
        else:
            values = array.get() if lib == "cupy" else np.asarray(array)
            if values.dtype.kind not in _NOT_REAL:
                if integers and values.dtype.kind in "biu":  # beyond int64: its own value
                    wide = values.dtype.kind == "u" and (values > np.iinfo(np.int64).max).any()
                    return np.array(values, dtype=np.float64 if wide else np.int64)
                return np.array(values, dtype=np.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        if raised_by_caller(exc):
            raise
        raise InfiniError(Status.BAD_PARAM, f"{name} is not an array of numbers: {exc}") from exc
    raise InfiniError(Status.BAD_PARAM, f"{name} has dtype {values.dtype}; expected real numbers")


def _writing(target: Any) -> AbstractContextManager[Any]:
    """Where ``target`` is written in place: a torch tensor under ``inference_mode``, whatever
    its autograd state (a ``Parameter``, an inference tensor, a gradient that requires grad
    itself), as torch's ``load_state_dict`` writes its parameters under ``no_grad`` (torch
    refuses an in-place write otherwise); torch's own op bumps its version counter there."""
    if library("target", target) != "torch":
        return nullcontext()
    import torch

    return torch.inference_mode()


def assign(target: Any, values: np.ndarray) -> None:
    """Write host ``values`` into ``target`` in place (its dtype, library and device)."""
    values = new(values, place("target", target), str(target.dtype).removeprefix("torch."))
    with _writing(target):
        target[...] = values


def add(target: Any, values: Any) -> None:
    """``target += values`` in place (float arrays of one library, device and shape)."""
    with _writing(target):
        target += values
