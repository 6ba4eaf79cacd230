"""``Operand``: one array argument as the door (``door.operand``) describes it, and the rules
for arrays a call writes in place."""

import functools
from dataclasses import dataclass, field
from typing import Any

from ..enums import Device, Status
from ..errors import InfiniError
from ..tensor import ITEMSIZE, TensorDesc


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


@functools.lru_cache(maxsize=4096)
def byte_extent(desc: TensorDesc) -> tuple[int, int]:
    """``[low, high)``: the bytes a tensor of ``desc`` touches, relative to its pointer."""
    if desc.numel == 0:
        return 0, 0
    itemsize = ITEMSIZE[desc.dtype]
    low = sum(min(0, (n - 1) * s) for n, s in zip(desc.shape, desc.strides, strict=True))
    high = sum(max(0, (n - 1) * s) for n, s in zip(desc.shape, desc.strides, strict=True))
    return low * itemsize, (high + 1) * itemsize


def overlap(a: TensorDesc, a_ptr: int, b: TensorDesc, b_ptr: int) -> bool:
    """Whether tensors ``a`` at ``a_ptr`` and ``b`` at ``b_ptr`` (one device) may have a byte
    in common: their byte ranges meet, except for two vectors of one stride whose elements
    interleave without touching (``buf[0::2]`` and ``buf[1::2]``). Conservative on other
    interleavings. A tensor with no elements has no byte: it overlaps nothing, wherever its
    pointer lies (as PyTorch's ``get_overlap_status``)."""
    (a_low, a_high), (b_low, b_high) = byte_extent(a), byte_extent(b)
    if a_low == a_high or b_low == b_high:
        return False
    if a_ptr + a_low >= b_ptr + b_high or b_ptr + b_low >= a_ptr + a_high:
        return False
    a_size, b_size = ITEMSIZE[a.dtype], ITEMSIZE[b.dtype]
    if a.ndim == b.ndim == 1:
        step = abs(a.strides[0]) * a_size
        if step and step == abs(b.strides[0]) * b_size:
            offset = (b_ptr - a_ptr) % step  # where b's elements start within a's steps
            return offset < a_size or step - offset < b_size
    return True


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
