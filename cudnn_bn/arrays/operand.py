"""``Operand``: one array argument as the door (``door.operand``) describes it, and the rules
for arrays a call writes in place."""

from dataclasses import dataclass, field
from typing import Any

from ..enums import Device, Status
from ..errors import InfiniError
from ..tensor import TensorDesc, byte_extent, overlap


@dataclass(frozen=True)
class Operand:
    """One array argument: where it lives, its descriptor, its data pointer, which library
    allocates arrays like it (``kinds.Kind``), and ``readonly``: why writing through ``ptr``
    would not reach the caller's data ("" when it would), e.g. NumPy's ``writeable=False``, a
    DLPack producer's copy. ``owner`` keeps what ``ptr`` points into alive (a DLPack capsule,
    a resolved copy) for as long as the operand is used."""

    device: Device
    device_id: int
    desc: TensorDesc
    ptr: int
    readonly: str = ""
    kind: Any = None
    owner: Any = field(default=None, compare=False, repr=False)

    @property
    def signature(self) -> tuple:
        """Everything about the operand but its address: what a per-problem plan depends on."""
        return (self.kind, self.device, self.device_id, self.desc, self.readonly)

    @property
    def byte_range(self) -> tuple[int, int]:
        """``[first, end)`` bytes its elements lie in (empty for no elements)."""
        low, high = byte_extent(self.desc)
        return self.ptr + low, self.ptr + high


def shares_memory(a: Operand, b: Operand) -> bool:
    """Whether operands ``a`` and ``b`` may have a byte in common (``overlap``)."""
    if (a.device, a.device_id) != (b.device, b.device_id):
        return False
    return overlap(a.desc, a.ptr, b.desc, b.ptr)


def refuse_unwritable(name: str, op: Operand) -> None:
    """BAD_PARAM where writing ``op`` in place would not reach the caller's data."""
    if op.readonly:
        raise InfiniError(Status.BAD_PARAM, f"{name} is {op.readonly}, but it is written in place")


def refuse_overlap(name: str, other: str) -> InfiniError:
    return InfiniError(
        Status.BAD_PARAM,
        f"{name} and {other} share memory; {name} is written in place and must not overlap "
        "any other argument",
    )


def check_written(written: dict[str, Operand], read: dict[str, Operand]) -> None:
    """Arrays a call writes in place: each writable, none sharing memory with another one
    written or with one the call reads; BAD_PARAM naming both, before anything is written."""
    for name, op in written.items():
        refuse_unwritable(name, op)
    names = list(written)
    for i, name in enumerate(names):
        for other, op in [*((n, written[n]) for n in names[i + 1 :]), *read.items()]:
            if shares_memory(written[name], op):
                raise refuse_overlap(name, other)
