"""The order in which benchmarks interleave the ways they compare, run by run."""

from collections.abc import Mapping
from typing import TypeVar

V = TypeVar("V")


def alternating(ways: Mapping[str, V], run: int) -> list[tuple[str, V]]:
    """``ways`` in their order on even runs, reversed on odd ones: a fixed order favoured the
    way that runs after another by about 10 % (two trees of the CPU engine measured side by
    side, session 10), so each way runs first as often as last."""
    items = list(ways.items())
    return items if run % 2 == 0 else items[::-1]
