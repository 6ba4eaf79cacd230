"""Tests over a call's pointers, written as source once per problem: a per-problem plan's
call has them inline (``api.call``), a CPU kernel evaluates them compiled (``backends.cpu``).
Chained comparisons over the pointers themselves cost less than any loop over pairs."""

from collections.abc import Callable, Sequence, Set
from typing import Any


def meeting(
    pairs: list[tuple[int, int, int, int]], in_place: Set[tuple[int, int]] = frozenset()
) -> str:
    """The source of a test over a call's pointers ``ptrs``: true where, for some pair
    ``(a, b, low, high)``, ``low < ptrs[a] - ptrs[b] < high``: where the bytes of tensors at
    those pointers may meet (bounds from their byte extents), for an exact check to decide;
    for a pair ``(a, b)`` of ``in_place``, other than at one address. Empty for no pairs."""
    return " or ".join(
        f"{low} < ptrs[{a}] - ptrs[{b}] < {high}"
        + (f" and ptrs[{a}] != ptrs[{b}]" if (a, b) in in_place else "")
        for a, b, low, high in pairs
    )


OUT_OF_RANGE = -1 << 64  # the bits of an int no address in [0, 2**64) has (all: negative)


def bad_bits(size: int) -> int:
    """The bits no address of an item of ``size`` bytes has (0: no elements, any address):
    its alignment's and ``OUT_OF_RANGE``."""
    return OUT_OF_RANGE | max(size - 1, 0)


def misplaced(groups: dict[int, list[int]]) -> str:
    """The source of a test over a call's pointers ``ptrs``: true where one of those at the
    indices ``groups[size]`` may be no address of an item of ``size`` bytes: NULL (for sizes
    other than 0), or with one of its ``bad_bits``. Per size, one C-level scan for a 0 and
    one test of the bits of the pointers' OR; empty for no groups."""
    return " or ".join(
        (f"0 in ({', '.join(values)},) or " if size else "")
        + f"({' | '.join(values)}) & {bad_bits(size)}"
        for size, ats in groups.items()
        for values in [[f"ptrs[{at}]" for at in ats]]
    )


def compiled_test(source: str, **names: Any) -> Callable[[Sequence[int]], bool]:
    """A function of ``ptrs`` evaluating the test ``source`` (``meeting``'s; false where it
    is empty), with ``names`` in scope."""
    return eval(f"lambda ptrs: {source or False}", names)
