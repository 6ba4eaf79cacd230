"""What every operator descriptor shares: a backend kernel built once for validated tensors.

A descriptor holds its handle, its tensors (validated by the operator module before it is
built) and its attributes; the backend kernel built from them caches everything that does
not depend on data (cuDNN descriptors, workspace and reserve sizes). ``_launch`` does the
per-call checks every operator needs and runs the kernel; a cuDNN failure comes back with a
snippet that reproduces the problem.
"""

import dataclasses
import enum
import os
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Self

from ..address_tests import Disjoint, compiled_test, misplaced
from ..enums import Device, Status
from ..errors import InfiniError, integer, raised_by_caller
from ..runtime import Handle
from ..tensor import ITEMSIZE
from .empty import EmptyProblem

# The workspace holds F64 scratch, cuDNN's own and staged per-channel slices at 256-byte
# offsets, the reserve cuDNN's own: each refused unless 16-byte aligned where it is used
# (every CUDA and host allocator gives at least that).
WORKSPACE_ALIGNMENT = 16


def backend_class(device: Device, op_name: str) -> Any:
    """The class implementing operator ``op_name`` on ``device``'s backend."""
    if device == Device.CPU:
        backend = _cpu_backend()
    elif device == Device.NVIDIA:
        from ..backends import nvidia as backend
    else:
        raise InfiniError(Status.DEVICE_TYPE_NOT_SUPPORTED, f"no backend for device {device!r}")
    return getattr(backend, op_name)


def _cpu_backend() -> Any:
    """``backends.cpu``, which imports numba: numba's own refusal of its settings at import
    (``NUMBA_NUM_THREADS=0``: a ValueError naming no variable) is NOT_IMPLEMENTED naming the
    ``NUMBA_`` variables set, as ``NUMBA_DISABLE_JIT`` is; a failed import is tried again
    at the next call. Only numba's import is taken for numba's: any other failure is raised
    as it is."""
    try:
        import numba  # noqa: F401 (its import alone, which checks its settings)
    except Exception as exc:
        if raised_by_caller(exc):
            raise
        settings = ", ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NUMBA_"))
        raise InfiniError(
            Status.NOT_IMPLEMENTED,
            f"the CPU engine needs numba, whose import failed ({type(exc).__name__}: {exc}); "
            f"numba's settings: {settings or 'none set'}",
        ) from exc
    from ..backends import cpu

    return cpu


_WORDS = 1 << 64
_SIZES = ("workspace", "workspace_size", "stream")


def word(name: str, value: Any) -> int:
    """``value`` as a compute's argument ``name`` (an address, a size or a stream: C's
    ``void *``, ``size_t``, ``cudaStream_t``): an integer from 0 to 2**64 - 1 (Python's or
    NumPy's; None and False for 0, NULL); BAD_PARAM for anything else (a float, a string,
    True), which a kernel taking ints would otherwise convert, or crash on."""
    if value is None or value is False:
        return 0
    number = integer(name, value)
    if number is None:
        kind = type(value).__name__
        raise InfiniError(Status.BAD_PARAM, f"{name} must be an int (0 to 2**64 - 1); got {kind}")
    if not 0 <= number < _WORDS:
        raise InfiniError(Status.BAD_PARAM, f"{name} is {number}, not in 0 to 2**64 - 1")
    return number


def _show(value: Any) -> str:
    """An attribute as the array API spells it (enums by lowercase name)."""
    return repr(value.name.lower()) if isinstance(value, enum.Enum) else repr(value)


class Launch(NamedTuple):
    """An owner's launch of a descriptor (``OperatorDescriptor.launcher``): ``call(values,
    workspace, stream)`` runs the kernel on ``values``, the pointers of ``fields`` in order
    (a None field: give 0); a ``direct`` one (a kernel that takes no workspace and no
    stream: the CPU engine's one-call passes) is ``call(*values)``."""

    fields: tuple[str | None, ...]
    call: Callable[..., None]
    direct: bool = False

    def run(self, values: tuple, workspace: int, stream: int) -> None:
        """``call`` on ``values`` in its form, for a launch that wraps this one."""
        if self.direct:
            self.call(*values)
        else:
            self.call(values, workspace, stream)


def _batched(launch: Launch, kernel: Any, count: int, steps: dict[str | None, int]) -> Launch:
    """``launch`` (of one problem) over ``count`` problems at ``steps`` bytes apart
    (``OperatorDescriptor.launcher``): the kernel's ``batched()`` launch where it has one,
    else ``launch`` once per problem."""
    batched = kernel.batched(count, steps) if hasattr(kernel, "batched") else None
    if batched is not None:
        return Launch(*batched)
    offsets = [steps.get(f, 0) for f in launch.fields]

    def call(values: tuple, workspace: int, stream: int) -> None:
        for b in range(count):
            shifted = tuple(v + b * s for v, s in zip(values, offsets, strict=True))
            launch.run(shifted, workspace, stream)

    return Launch(launch.fields, call)


class Build:
    """One build of a descriptor: its checked attributes, the backend kernel made for them
    and the pointers they need, swapped as one object so that a compute reads them once.

    A compute holds the build it read (``users``); a retired build (replaced by
    ``set_attributes`` or destroyed) closes its kernel when its last user lets go.
    ``suspect``: a test over a compute's pointers, true where the ``needed`` ones may be
    misaligned or a written one may overlap another; ``disjoint`` looks closer at the latter
    (``OperatorDescriptor._suspect``).
    """

    __slots__ = ("attributes", "disjoint", "kernel", "needed", "retired", "suspect", "users")

    def __init__(
        self,
        attributes: Any,
        kernel: Any,
        needed: tuple[str, ...],
        checks: tuple[Callable[[Sequence[int]], bool], Disjoint],
    ) -> None:
        self.attributes, self.kernel, self.needed = attributes, kernel, needed
        self.suspect, self.disjoint = checks
        self.users, self.retired = 0, False

    def close_if_free(self) -> None:
        """Close the kernel of a retired build that no compute holds (lock held or sole owner)."""
        if self.retired and not self.users and hasattr(self.kernel, "close"):
            self.kernel.close()


class OperatorDescriptor:
    """Base of the operator descriptors: lifecycle, cached sizes, per-call checks.

    Thread-safe as a C descriptor must be: ``set_attributes`` builds the new kernel aside and
    swaps it in whole while other threads compute; each compute runs the build it leased.
    """

    op_name: ClassVar[str]
    _owner: str | None = None  # who runs it through ``launcher``, if anyone
    pointers: ClassVar[type]  # the NamedTuple of pointers a launch takes
    zeroed_when_empty: ClassVar[tuple[str, ...]] = ()  # outputs a problem with no values zeroes
    written: ClassVar[frozenset[str]]  # the tensors a compute writes (in place or not)

    def __init__(self, handle: Handle, tensors: NamedTuple, attributes: Any) -> None:
        # packs a compute's pointers and sizes as uint64s: refuses any that is not one
        self._words = struct.Struct(f"{len(self.pointers._fields) + len(_SIZES) + 1}Q")
        self.handle = handle
        self.tensors = tensors
        self._backend_type = backend_class(handle.device, self.op_name)
        self._lock = threading.Lock()
        self._build: Build | None = self._make(attributes)

    def check_attributes(self, attributes: Any) -> Any:
        """The attributes, validated against the tensors (operators override this)."""
        return attributes

    def set_attributes(self, **changes: Any) -> None:
        """Change some attributes: build a kernel for them, then swap it in; a compute
        running meanwhile finishes with the build it started with."""
        self._not_owned("changed")
        build = self._make(dataclasses.replace(self._live().attributes, **changes))
        with self._lock:
            old = self._build
            if old is not None:
                self._build = build
            retired = build if old is None else old  # destroyed meanwhile: drop the new one
            retired.retired = True
            retired.close_if_free()
        if old is None:
            self._live()  # BAD_PARAM

    def _make(self, attributes: Any) -> Build:
        """A build for ``attributes``; a problem with no values per channel (a zero dimension
        other than C) gets no backend kernel, only zeros for its ``zeroed_when_empty``."""
        attributes = self.check_attributes(attributes)
        needed = self.needed_pointers(attributes)
        if self.tensors.input.numel:
            kernel = self._backend_type(self.tensors, attributes, self.handle.device_id)
            return Build(attributes, kernel, needed, self._suspect(needed, self.written))
        zeroed = {n: getattr(self.tensors, n) for n in self.zeroed_when_empty if n in needed}
        kernel = EmptyProblem(zeroed, self.handle.device, self.handle.device_id)
        empty = {
            n for n, d in zip(self.tensors._fields, self.tensors, strict=True) if d and not d.numel
        }
        needed = tuple(n for n in needed if n not in empty)
        return Build(attributes, kernel, needed, self._suspect(needed, frozenset(zeroed)))

    def _with_elements(self, needed: tuple[str, ...]) -> dict[int, str]:
        """The tensors of ``needed`` that have elements, by their index in ``pointers``."""
        fields = self.pointers._fields
        return {
            fields.index(n): n
            for n in needed
            if (d := getattr(self.tensors, n, None)) is not None and d.numel
        }

    def _in_place(self, written: str, other: str, written_ones: frozenset[str]) -> str:
        """How ``written`` may lie over ``other``: "exactly" where both are data tensors (the
        input's shape) of one layout and ``other`` is only read, so that each element is read
        before it is written over (InfiniCore's own tests run the backward with grad_input
        at grad_output's address); "anyhow" for such data tensors of other layouts on the CPU
        engine, which writes an output that overlaps an input so through scratch
        (``backends.cpu``); "" for no overlap at all."""
        a, b = getattr(self.tensors, written), getattr(self.tensors, other)
        data = a.shape == b.shape == self.tensors.input.shape
        if other in written_ones or not data:
            return ""
        return "anyhow" if self.handle.device == Device.CPU else "exactly" if a == b else ""

    def _suspect(
        self, needed: tuple[str, ...], written: frozenset[str]
    ) -> tuple[Callable[[Sequence[int]], bool], Disjoint]:
        """A build's ``suspect``, a test over a compute's pointers (``pointers`` order) that is
        true where a tensor of ``needed`` may be misaligned to its elements or one of
        ``written`` may meet another's bytes other than as ``_in_place`` lets it, and its
        ``disjoint``, the closer look at the latter (``_check_addresses``): what the array
        API's plans test (``api.call``), so that the C API holds a caller to the same rules."""
        tensors = self._with_elements(needed)
        groups: dict[int, list[int]] = {}
        for at, name in tensors.items():
            groups.setdefault(ITEMSIZE[getattr(self.tensors, name).dtype], []).append(at)
        allowed = {
            (w, o): self._in_place(tensors[w], tensors[o], written)
            for w in tensors
            if tensors[w] in written
            for o in tensors
            if o != w and not (tensors[o] in written and o < w)  # each pair once
        }
        disjoint = Disjoint(
            {at: getattr(self.tensors, n) for at, n in tensors.items()},
            [pair for pair, how in allowed.items() if how != "anyhow"],
            {pair for pair, how in allowed.items() if how == "exactly"},
        )
        test = " or ".join(filter(None, (misplaced(groups), disjoint.suspect)))
        return compiled_test(test), disjoint

    def _check_addresses(self, build: Build, ptrs: NamedTuple) -> None:
        """BAD_PARAM naming the first tensor of ``build.needed`` misaligned to its elements,
        or the first written one that overlaps another other than as ``_in_place`` lets it
        (in ``pointers`` order): a kernel would read it wrongly, or write over what it still
        reads."""
        if not build.suspect(ptrs):
            return
        for name in self._with_elements(build.needed).values():
            size = ITEMSIZE[getattr(self.tensors, name).dtype]
            if getattr(ptrs, name) % size:
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"{name} {getattr(ptrs, name):#x} is not aligned to its {size}-byte elements",
                )
        found = build.disjoint.clash(ptrs)
        if found is not None:
            w, o = (self.pointers._fields[at] for at in found)
            raise InfiniError(
                Status.BAD_PARAM,
                f"{w} and {o} share memory; {w} is written and must not overlap any other "
                "argument but a read data tensor of its layout at its address",
            )

    def needed_pointers(self, attributes: Any) -> tuple[str, ...]:
        """The pointers a compute with ``attributes`` reads or writes, each required to be
        non-NULL: by default those of every tensor present (operators with optional operands
        override this)."""
        return tuple(
            name
            for name, desc in zip(self.tensors._fields, self.tensors, strict=True)
            if desc is not None
        )

    def uses_reserve(self, attributes: Any, given: bool) -> bool:
        """Whether a compute with ``attributes`` checks the reserve buffer (``given``: its
        pointer is not NULL)."""
        return True

    @property
    def attributes(self) -> Any:
        """The attributes of the current build."""
        return self._live().attributes

    @property
    def _kernel(self) -> Any:
        """The current backend kernel, None once destroyed."""
        build = self._build
        return None if build is None else build.kernel

    @property
    def engine(self) -> str:
        """Which engine runs this problem: ``"numpy"``, ``"cudnn"`` or ``"cupy"``, or
        ``"empty"`` for a problem with no values per channel."""
        return self._live().kernel.engine

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace each compute needs."""
        return self._live().kernel.workspace_size

    @property
    def reserve_size(self) -> int:
        """Bytes of reserve space a training forward fills for its backward (0: none)."""
        return self._live().kernel.reserve_size

    def _launch(
        self,
        ptrs: NamedTuple,
        workspace: int,
        workspace_size: int,
        stream: int,
        reserve_size: int | None = None,
    ) -> None:
        """Check sizes and the needed pointers, then run; writes nothing on error.

        ``reserve_size`` is the caller's reserve buffer size where the operator takes one.
        """
        sizes = (workspace, workspace_size, stream, 0 if reserve_size is None else reserve_size)
        try:  # every value an integer in [0, 2**64) at C speed (struct, which takes any
            # __index__ too: a float sum's type says all are Python's ints, and NumPy's
            # integers, added as floats, overflow with no warning); True is no address
            self._words.pack(*ptrs, *sizes)  # (False is 0 to Python, and so NULL here)
            total = sum(ptrs, sum(sizes, 0.0))
            exact = type(total) is float and True not in ptrs and True not in sizes
        except (struct.error, TypeError):
            exact = False
        if not exact:
            ptrs = type(ptrs)(*map(word, ptrs._fields, ptrs))
            workspace, workspace_size, stream = map(word, _SIZES, sizes[:3])
            reserve_size = None if reserve_size is None else word("reserve_size", reserve_size)
        build = self._lease()
        try:
            given = bool(getattr(ptrs, "reserve", 0))
            needed = self._checked_sizes(build, workspace_size, reserve_size, given)
            self._check_workspace(build, workspace)
            for name in needed:
                if not getattr(ptrs, name):
                    raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
            self._check_addresses(build, ptrs)
            if "reserve" in needed and ptrs.reserve % WORKSPACE_ALIGNMENT:
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"reserve {ptrs.reserve:#x} is not {WORKSPACE_ALIGNMENT}-byte aligned",
                )
            try:
                build.kernel.run(ptrs, workspace, stream)
            except InfiniError as exc:
                raise self._described(exc, build) from exc
        finally:
            self._let_go(build)

    def launcher(
        self,
        owner: str,
        workspace_size: int,
        reserve_size: int | None = None,
        reserve: bool = False,
        batch: tuple[int, dict[str | None, int]] | None = None,
        current: bool = False,
    ) -> Launch:
        """``compute`` for the ``owner`` of this descriptor (the array API's plans), its size
        checks made once, here (``reserve``: whether launches give one): a ``Launch``, whose
        ``call(values, workspace, stream)`` runs the build's kernel at once on the pointers
        ``values`` of its ``fields``. The caller gives a non-NULL pointer for every tensor with
        elements, outputs that overlap no input (so the CPU engine skips its overlap check),
        and never changes or destroys the descriptor while a launch runs: from now on
        ``set_attributes`` and ``destroy`` refuse (the descriptor is public:
        ``descriptor_cache.descriptors()``), so that no thread can change the build a launch
        runs, and the launch holds its build (as a compute does) until it is dropped, so that
        closing the descriptor (``with descriptor:``) closes no kernel it runs. A kernel with
        ``direct()`` (the CPU engine's one-call passes, which raise nothing) is called as it
        says, without the pointer tuple. ``batch``: ``(count, steps)``, a launch runs
        ``count`` problems of this descriptor's layout, problem ``b``'s pointers the given
        ones plus ``b * steps[field]`` bytes (a field not in ``steps``: 0), in one call where
        the kernel has ``batched()`` for them, else one launch per problem. ``current``: the
        owner launches only with this descriptor's device current (the array API's CuPy
        plans, inside their scope), so a kernel with ``run_current`` switches none."""
        build = self._lease()
        try:
            self._owner = owner
            self._checked_sizes(build, workspace_size, reserve_size, reserve)
            launch = self._launch_of(build, current)
            if batch is not None:
                launch = _batched(launch, build.kernel, *batch)
        except BaseException:
            self._let_go(build)
            raise
        weakref.finalize(launch.call, self._let_go, build).atexit = False  # as the cache's
        return launch

    def _launch_of(self, build: Build, current: bool) -> Launch:
        """``launcher``'s ``Launch`` of ``build`` (``current``: as ``launcher`` says)."""
        kernel = build.kernel
        direct = kernel.direct() if hasattr(kernel, "direct") else None
        if direct is not None:
            return Launch(*direct, direct=True)
        run = getattr(kernel, "run_current" if current else "run_disjoint", kernel.run)
        pointers, checks_workspace = self.pointers, bool(kernel.workspace_size)

        def call(values: tuple, workspace: int, stream: int) -> None:
            if checks_workspace:
                self._check_workspace(build, workspace)
            try:
                run(tuple.__new__(pointers, values), workspace, stream)
            except InfiniError as exc:
                raise self._described(exc, build) from exc

        return Launch(pointers._fields, call)

    def _checked_sizes(
        self, build: Build, workspace_size: int, reserve_size: int | None, reserve: bool
    ) -> tuple[str, ...]:
        """The pointers a compute must be given (``build.needed``, and ``reserve`` where it is
        checked: ``reserve`` says whether one is given), after the size checks."""
        kernel = build.kernel
        if workspace_size < kernel.workspace_size:
            raise InfiniError(
                Status.INSUFFICIENT_WORKSPACE,
                f"workspace_size is {workspace_size} bytes; "
                f"this descriptor needs {kernel.workspace_size}",
            )
        if (
            reserve_size is None
            or not kernel.reserve_size
            or not self.uses_reserve(build.attributes, reserve)
        ):
            return build.needed
        if reserve_size < kernel.reserve_size:
            raise InfiniError(
                Status.INSUFFICIENT_WORKSPACE,
                f"reserve_size is {reserve_size} bytes; "
                f"this descriptor needs {kernel.reserve_size}",
            )
        return (*build.needed, "reserve")

    def _check_workspace(self, build: Build, workspace: int) -> None:
        needed = build.kernel.workspace_size
        if needed and not workspace:
            raise InfiniError(
                Status.NULL_POINTER, f"workspace is NULL but {needed} bytes are needed"
            )
        if needed and workspace % WORKSPACE_ALIGNMENT:
            raise InfiniError(
                Status.BAD_PARAM,
                f"workspace {workspace:#x} is not {WORKSPACE_ALIGNMENT}-byte aligned",
            )

    def _described(self, exc: InfiniError, build: Build) -> InfiniError:
        """A kernel's failure, described well enough to reproduce."""
        return InfiniError(exc.status, f"{str(exc).partition(': ')[2]}\n{self.repro(build)}")

    def repro(self, build: Build | None = None) -> str:
        """A description of this problem precise enough to rebuild it, for bug reports."""
        build = build or self._live()
        lines = [
            f"To reproduce: {self.op_name} on {self.handle.device.name}:{self.handle.device_id}"
        ]
        for name, desc in zip(self.tensors._fields, self.tensors, strict=True):
            if desc is not None:
                lines.append(
                    f"  {name}: {desc.dtype.name} shape {desc.shape} strides {desc.strides}"
                )
        shown = ", ".join(
            f"{f.name}={_show(getattr(build.attributes, f.name))}"
            for f in dataclasses.fields(build.attributes)
        )
        lines.append(f"  attributes: {shown}  (engine {build.kernel.engine})")
        return "\n".join(lines)

    def destroy(self) -> None:
        """Release the backend's resources (once no compute uses them); later use raises
        BAD_PARAM."""
        self._live()
        self._not_owned("destroyed")
        self._release()

    def _not_owned(self, what: str) -> None:
        """BAD_PARAM where this descriptor has an owner (``launcher``) that runs it."""
        if self._owner is not None:
            raise InfiniError(
                Status.BAD_PARAM,
                f"this descriptor belongs to {self._owner}, which runs it: it cannot be {what}",
            )

    def _release(self) -> None:
        with self._lock:
            build, self._build = self._build, None
            if build is not None:
                build.retired = True
                build.close_if_free()

    def _lease(self) -> Build:
        """The current build, held until the caller lets it go (``_let_go``)."""
        with self._lock:
            build = self._live()
            build.users += 1
        return build

    def _let_go(self, build: Build) -> None:
        """Drop a hold on ``build`` (``_lease``); a retired build with no holder closes."""
        with self._lock:
            build.users -= 1
            build.close_if_free()

    def _live(self) -> Build:
        build = self._build
        if build is None:
            raise InfiniError(Status.BAD_PARAM, f"{self.op_name} descriptor used after destroy()")
        return build

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._release()
