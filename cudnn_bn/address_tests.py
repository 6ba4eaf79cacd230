"""Tests over a call's pointers, written as source once per problem: a per-problem plan's
call has them inline (``api.call``), a CPU kernel evaluates them compiled (``backends.cpu``).
Chained comparisons over the pointers themselves cost less than any loop over pairs."""

from collections.abc import Callable, Sequence
from typing import Any


def meeting(pairs: list[tuple[int, int, int, int]]) -> str:
    """The source of a test over a call's pointers ``ptrs``: true where, for some pair
    ``(a, b, low, high)``, ``low < ptrs[a] - ptrs[b] < high``: where the bytes of tensors at
    those pointers may meet (bounds from their byte extents), for an exact check to decide;
    empty for no pairs."""
    return " or ".join(f"{low} < ptrs[{a}] - ptrs[{b}] < {high}" for a, b, low, high in pairs)


def compiled_test(source: str, **names: Any) -> Callable[[Sequence[int]], bool]:
    """A function of ``ptrs`` evaluating the test ``source`` (``meeting``'s; false where it
    is empty), with ``names`` in scope."""
    return eval(f"lambda ptrs: {source or False}", names)
