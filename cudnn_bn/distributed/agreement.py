"""What the ranks tell each other first, and how their statistics combine.

Every pass starts with an all-gather of a fixed-size header (so that ranks which disagree on
the channel count cannot post collectives of different sizes and hang): this rank's status
(0, or the ``Status`` its own validation raised), its sample count per channel, the input's
rank, its shape but N, its dtype and two pass-specific numbers (eps and momentum; whether
``grad_input`` is wanted). Every rank reads the same gathered headers, so every rank reaches
the same verdict: all go on, or all raise.
"""

from collections.abc import Sequence

import numpy as np

from ..enums import DataType, Status
from ..errors import InfiniError

HEADER_SIZE = 10
_STATUS, _COUNT, _NDIM, _SHAPE, _DTYPE, _PARAMS = 0, 1, 2, slice(3, 7), 7, slice(8, 10)


def header(
    status: int,
    count: int = 0,
    shape: Sequence[int] = (),
    dtype: int = 0,
    params: tuple[float, float] = (0.0, 0.0),
) -> np.ndarray:
    """This rank's header as float64 (every field is exact there)."""
    values = np.zeros(HEADER_SIZE)
    values[_STATUS], values[_COUNT], values[_NDIM], values[_DTYPE] = (
        status,
        count,
        len(shape),
        dtype,
    )
    values[_SHAPE] = (*shape[1:], 0, 0, 0, 0)[:4]
    values[_PARAMS] = params
    return values


def _describe(row: np.ndarray) -> str:
    dims = ", ".join(str(int(d)) for d in row[_SHAPE][: int(row[_NDIM]) - 1])
    return f"(N, {dims}) {DataType(int(row[_DTYPE])).name}"


def check_agreement(headers: np.ndarray, pass_name: str, params: str) -> int:
    """The global sample count per channel, once every rank's header agrees; else raises the
    same ``InfiniError`` on every rank (call it after re-raising this rank's own failure)."""
    failed = np.flatnonzero(headers[:, _STATUS])
    if failed.size:
        rank = int(failed[0])
        status = Status(int(headers[rank, _STATUS]))
        raise InfiniError(
            status,
            f"{pass_name} failed on rank {rank} ({status.name}); no rank wrote anything",
        )
    first = headers[0]
    problems = (
        ("the input's shape", Status.BAD_TENSOR_SHAPE, slice(_NDIM, _DTYPE)),
        ("the input's dtype", Status.BAD_TENSOR_DTYPE, slice(_DTYPE, _DTYPE + 1)),
        (params, Status.BAD_PARAM, _PARAMS),
    )
    for what, status, fields in problems:
        differ = [
            r for r, row in enumerate(headers) if not np.array_equal(row[fields], first[fields])
        ]
        if differ:
            if status == Status.BAD_PARAM:
                seen = "; ".join(
                    f"rank {r}: {tuple(row[_PARAMS])}" for r, row in enumerate(headers)
                )
            else:
                seen = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(headers))
            raise InfiniError(status, f"{pass_name}: the ranks disagree on {what} ({seen})")
    return int(headers[:, _COUNT].sum())


def counts(headers: np.ndarray) -> np.ndarray:
    """Each rank's sample count per channel."""
    return headers[:, _COUNT].copy()


def combine(
    n: np.ndarray, mean: np.ndarray, m2: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """``(count, mean, M2)`` of the union of per-rank ``(n[r], mean[r], m2[r])`` (rows of
    shape ``(ranks,)``, ``(ranks, C)``, ``(ranks, C)``), combined pairwise by Chan, Golub and
    LeVeque's update (1979): no sums of squares, so no cancellation. Ranks with n = 0 add
    nothing."""
    n, mean, m2 = n.astype(np.float64), mean.astype(np.float64), m2.astype(np.float64)
    while n.size > 1:
        if n.size % 2:  # pad with an empty rank
            n = np.append(n, 0.0)
            mean, m2 = np.vstack([mean, mean[:1] * 0]), np.vstack([m2, m2[:1] * 0])
        na, nb = n[0::2], n[1::2]
        nab = na + nb
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(nab > 0, nb / nab, 0.0)[:, None]  # of b in the union
        delta = mean[1::2] - mean[0::2]
        mean = mean[0::2] + delta * share
        m2 = m2[0::2] + m2[1::2] + delta * delta * (na[:, None] * share)
        n = nab
    return float(n[0]), mean[0], m2[0]
