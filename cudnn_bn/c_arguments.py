"""Python values to C arguments, by the C type of the parameter, as ctypes converts them.

``converter(c_type)`` gives the conversion of one parameter type of ``include/``'s
prototypes (spelled as ``tests/c_headers.py`` parses them: ``"size_t const *"``). What a
ctypes foreign function with that prototype accepts is accepted here: Python numbers,
NumPy scalars and ctypes scalars (``c_int``, ``c_double``, ``c_float``, ``c_size_t`` ...)
for scalars; ``byref``, ``pointer``, ctypes arrays, ``c_void_p``, objects with
``_as_parameter_`` and integer addresses for pointers (and lists for the read-only size
arrays). Anything else is an ``InfiniError`` naming the parameter. Out-parameters
are resolved to an address only after checking that a write of their type fits in the
object they point to, so no conversion here ever leads to a write ctypes would not make;
``str`` and ``bytes`` are never written through. An integer address (of an out-parameter,
or a size array) is used only where the kernel can copy through it, so that memory the
process cannot write or read is a BAD_PARAM, not a SIGSEGV.
"""

import ctypes
import errno
import numbers
import operator
import os
from collections.abc import Callable
from typing import Any

from .enums import Status
from .errors import InfiniError, shown

# Linux never maps the first 64 KiB (vm.mmap_min_addr) and user space ends at 2**47 on
# x86-64, 2**48 on aarch64: a host address outside is no memory a caller owns.
MIN_HOST_ADDRESS, HOST_ADDRESS_END = 1 << 16, 1 << 48
POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)

_INTEGER_CODES, _FLOAT_CODES = set("bBhHiIlLqQ?"), set("fdg")
_CArg = type(ctypes.byref(ctypes.c_int()))  # what ctypes.byref returns

Converter = Callable[[Any, str], Any]
ArrayReader = Callable[[int], tuple[int, ...]]


def _bad(name: str, expected: str, value: Any) -> InfiniError:
    return InfiniError(
        Status.BAD_PARAM, f"{name} must be {expected}, got {shown(value)} ({type(value).__name__})"
    )


def _as_c(name: str, c_type: str, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, reading the caller's object for parameter ``name``: any error
    the object raises (its ``__index__``, ``__float__``, ``_as_parameter_``...) becomes a
    BAD_PARAM naming the parameter, as ctypes refuses what it cannot convert. (Not a context
    manager: this runs for every argument of every C call.)"""
    try:
        return function(*args)
    except InfiniError:
        raise
    except (ArithmeticError, TypeError, ValueError) as exc:
        raise InfiniError(
            Status.BAD_PARAM, f"{name} cannot be passed as {c_type}: {type(exc).__name__}: {exc}"
        ) from None


def _unwrap(value: Any) -> Any:
    """ctypes' ``_as_parameter_`` protocol (NumPy's ``arr.ctypes`` uses it)."""
    return getattr(value, "_as_parameter_", value)


def _ctype_code(value: Any) -> str:
    return type(value)._type_ if isinstance(value, ctypes._SimpleCData) else ""


def _is_integer_type(ctype: type) -> bool:
    return issubclass(ctype, ctypes._SimpleCData) and ctype._type_ in _INTEGER_CODES


def integer(bits: int, signed: bool, c_type: str) -> Converter:
    """An integer parameter: Python and NumPy integers, ctypes integer scalars; in range."""
    low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)

    def convert(value: Any, name: str) -> int:
        if _ctype_code(value) in _INTEGER_CODES:
            value = value.value
        try:
            number = operator.index(value)
        except TypeError:
            raise _bad(name, f"an integer ({c_type})", value) from None
        if not low <= number < high:
            raise InfiniError(
                Status.BAD_PARAM, f"{name} is {number}, outside the range of {c_type}"
            )
        return number

    return convert


def double(value: Any, name: str) -> float:
    """A ``double`` parameter: any real Python or NumPy number, ctypes float or integer."""
    if _ctype_code(value) in _INTEGER_CODES | _FLOAT_CODES:
        value = value.value
    if not isinstance(value, numbers.Real):
        raise _bad(name, "a number (double)", value)
    try:
        return float(value)
    except OverflowError:
        raise InfiniError(
            Status.BAD_PARAM, f"{name} is {shown(value)}, outside the range of double"
        ) from None


def _raw_address(value: Any, name: str) -> int:
    """An address given as a number (or ``c_void_p``), as ``void *`` takes it (mod 2**64)."""
    if isinstance(value, ctypes.c_void_p):
        return value.value or 0
    try:
        number = operator.index(value)
    except TypeError:
        raise _bad(
            name, "a pointer (an int address, c_void_p, byref, pointer or array)", value
        ) from None
    if not -(1 << 63) <= number < 1 << 64:
        raise InfiniError(Status.BAD_PARAM, f"{name} is {number}, not a 64-bit address")
    return number % (1 << 64)


def _object_address(value: Any) -> int:
    return ctypes.cast(value, ctypes.c_void_p).value or 0


def handle(value: Any, name: str) -> int:
    """An opaque handle or descriptor (``infiniopHandle_t``): its pointer value."""
    value = _unwrap(value)
    if value is None:
        return 0
    if isinstance(value, ctypes._Pointer):
        return _object_address(value)
    if isinstance(value, str | bytes | bytearray | float):
        raise _bad(name, "a handle (an int, c_void_p or ctypes pointer)", value)
    return _raw_address(value, name)


def data(const: bool) -> Converter:
    """A data pointer (``void *``; ``const void *`` also takes ``bytes``, read only)."""

    def convert(value: Any, name: str) -> int:
        value = _unwrap(value)
        if value is None:
            return 0
        if const and isinstance(value, bytes):
            return _object_address(value)
        if isinstance(value, ctypes._Pointer | _CArg):
            return _object_address(value)
        if isinstance(value, ctypes.Array):
            return ctypes.addressof(value)
        if isinstance(value, str | bytes | bytearray | float) or _ctype_code(value) not in (
            "",
            "P",
        ):
            raise _bad(name, "an address of memory (int, c_void_p, byref, pointer or array)", value)
        return _raw_address(value, name)

    return convert


def host_address(value: int, name: str) -> int:
    """``value`` (non-zero) if it can be host memory of the caller's; else BAD_PARAM."""
    if not MIN_HOST_ADDRESS <= value < HOST_ADDRESS_END:
        raise InfiniError(Status.BAD_PARAM, f"{name} ({value:#x}) is not a host address")
    return value


def _passed_through_kernel(address: int, size: int, name: str, write: bool) -> bytes:
    """The ``size`` bytes at a raw ``address`` (an out-parameter, ``write``: left as they
    were), copied by the kernel through a pipe, which reports EFAULT where this process
    cannot read (or write) them: a load or store of ours would die of SIGSEGV there. Only
    for integer addresses, whose memory ctypes never vouched for."""
    view = (ctypes.c_char * size).from_address(host_address(address, name))
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, view)
        if write:
            os.readv(read_end, [view])  # the same bytes back, through the kernel
            return b""
        return os.read(read_end, size)
    except OSError as exc:
        if exc.errno != errno.EFAULT:
            raise
        access = "write" if write else "read"
        raise InfiniError(
            Status.BAD_PARAM, f"{name} ({address:#x}) is no memory this process can {access}"
        ) from None
    finally:
        os.close(read_end)
        os.close(write_end)


def _target(value: Any) -> tuple[type, int, int | None] | None:
    """``(pointed-to type, address, end of the object or None)`` of a ctypes pointer-like
    value, or None when it is not one."""
    if isinstance(value, _CArg):
        obj = value._obj
        pointee = obj._type_ if isinstance(obj, ctypes.Array) else type(obj)
        return pointee, _object_address(value), ctypes.addressof(obj) + ctypes.sizeof(obj)
    if isinstance(value, ctypes.Array):
        address = ctypes.addressof(value)
        return value._type_, address, address + ctypes.sizeof(value)
    if isinstance(value, ctypes._Pointer):
        return value._type_, _object_address(value), None
    return None


def out(accepts: Callable[[type], bool], what: str, size: int) -> Converter:
    """An out-parameter written ``size`` bytes at a time: its address (0 for NULL), after
    checking that it points to a ``what`` (``accepts`` of its type) with room for ``size``."""

    def convert(value: Any, name: str) -> int:
        value = _unwrap(value)
        if value is None:
            return 0
        if isinstance(value, str | bytes | bytearray | float) or _ctype_code(value) not in (
            "",
            "P",
        ):
            raise _bad(name, f"a pointer to a {what} (byref, pointer, array or address)", value)
        found = _target(value)
        if found is None:
            address = _raw_address(value, name)
            if address:
                _passed_through_kernel(address, size, name, write=True)
            return address
        pointee, address, end = found
        if not accepts(pointee):
            raise InfiniError(
                Status.BAD_PARAM, f"{name} points to {pointee.__name__}; expected a {what}"
            )
        if address and end is not None and address + size > end:
            raise InfiniError(Status.BAD_PARAM, f"{name} has no room for a {what}")
        return address

    return convert


def in_array(element: type, c_type: str) -> Converter:
    """A read-only array of ``element`` (``size_t const *``): None for NULL, else a reader
    of its first n entries. Also takes lists and tuples of integers."""

    def convert(value: Any, name: str) -> ArrayReader | None:
        value = _unwrap(value)
        if value is None:
            return None
        if isinstance(value, list | tuple):
            items = value
        elif isinstance(value, ctypes.Array | ctypes._Pointer | _CArg):
            pointee, address, end = _target(value)  # type: ignore[misc]
            if not _is_integer_type(pointee):
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"{name} points to {pointee.__name__}; expected integers ({c_type})",
                )
            if not address:
                return None
            items = _Memory(pointee, address, end)
        elif isinstance(value, str | bytes | bytearray | float) or _ctype_code(value):
            raise _bad(name, f"an array of integers ({c_type})", value)
        else:
            address = _raw_address(value, name)
            if not address:
                return None
            items = _Memory(element, address, None)

        def read(n: int) -> tuple[int, ...]:
            return _as_c(name, c_type, _entries, n)

        def _entries(n: int) -> tuple[int, ...]:
            if isinstance(items, _Memory):
                values = items.read(n, name)
            elif len(items) != n:
                raise InfiniError(Status.BAD_PARAM, f"{name} has {len(items)} entries, not {n}")
            else:
                values = items
            try:
                return tuple(operator.index(v) for v in values)
            except TypeError:
                raise _bad(name, "integers", values) from None

        return read

    return convert


class _Memory:
    """Entries of ``element`` at ``address``; ``end`` bounds them where it is known."""

    def __init__(self, element: type, address: int, end: int | None) -> None:
        self.element, self.address, self.end = element, address, end

    def read(self, n: int, name: str) -> list[int]:
        size = ctypes.sizeof(self.element) * n
        if self.end is None:  # a raw address: read through the kernel
            copied = _passed_through_kernel(self.address, size, name, write=False)
            return list((self.element * n).from_buffer_copy(copied))
        if self.address + size > self.end:
            room = (self.end - self.address) // ctypes.sizeof(self.element)
            raise InfiniError(Status.BAD_PARAM, f"{name} has {room} entries, not {n}")
        return list((self.element * n).from_address(self.address))


def _is_pointer_type(ctype: type) -> bool:
    return issubclass(ctype, ctypes.c_void_p | ctypes._Pointer)


def _is_size_type(ctype: type) -> bool:
    return (
        issubclass(ctype, ctypes._SimpleCData)
        and ctype._type_ in "LQ"
        and (ctypes.sizeof(ctype) == ctypes.sizeof(ctypes.c_size_t))
    )


def converter(c_type: str) -> Converter:
    """The conversion of a parameter of C type ``c_type`` (as ``tests/c_headers.py`` spells
    types); an unknown type is a programming error (ValueError at import)."""
    fixed: dict[str, Converter] = {
        "double": double,
        "int": integer(32, True, "int"),
        "infiniDevice_t": integer(32, True, "infiniDevice_t"),
        "infiniDtype_t": integer(32, True, "infiniDtype_t"),
        "size_t": integer(64, False, "size_t"),
        "void *": data(const=False),
        "const void *": data(const=True),
        "size_t *": out(_is_size_type, "size_t", ctypes.sizeof(ctypes.c_size_t)),
        "size_t const *": in_array(ctypes.c_size_t, "size_t"),
        "ptrdiff_t const *": in_array(ctypes.c_ssize_t, "ptrdiff_t"),
    }
    if c_type in fixed:
        convert = fixed[c_type]
    elif c_type.startswith("infiniop") and c_type.endswith("_t *"):
        convert = out(_is_pointer_type, "pointer (c_void_p)", POINTER_SIZE)
    elif c_type.startswith("infiniop") and c_type.endswith("_t"):
        convert = handle
    else:
        raise ValueError(f"no conversion for C type {c_type!r}")

    def refusing(value: Any, name: str) -> Any:
        return _as_c(name, c_type, convert, value, name)

    return refusing
