"""Layouts of the arrays a pass makes: outputs, ``out=`` arrays, absent parameters."""

from typing import Any

from ..enums import DataType, Status
from ..errors import InfiniError
from ..ops.validation import HALF_DTYPES
from ..tensor import ITEMSIZE, TensorDesc


def packed_like(desc: TensorDesc, dtype: DataType | None = None) -> TensorDesc:
    """A packed tensor of ``desc``'s shape and layout (and ``dtype``, default its own)."""
    return TensorDesc(dtype or desc.dtype, desc.shape, desc.packed_strides())


def statistics_dtype(x: TensorDesc) -> DataType:
    """What per-channel values are stored as when the caller gives none to follow: F32 for
    F16/BF16 input (as cuDNN computes them), else the input's dtype."""
    return DataType.F32 if x.dtype in HALF_DTYPES else x.dtype


def absent_parameter(
    x: TensorDesc | None, descs: dict[str, TensorDesc | None], others: tuple[str, ...]
) -> TensorDesc:
    """The layout of a weight or bias the caller left out (None: 1 or 0 per channel): the
    dtype of the first per-channel operand given among ``others``, else ``statistics_dtype``."""
    if x is None or x.ndim < 2:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"input has shape {None if x is None else x.shape}; expected (N, C, ...)",
        )
    given = [descs[n] for n in others if descs.get(n) is not None]
    return TensorDesc.contiguous(given[0].dtype if given else statistics_dtype(x), (x.shape[1],))


def reserve_bytes(desc: TensorDesc | None, needed: int) -> int | None:
    """The size of a reserve the caller gives (``desc``; None: none given): one packed
    buffer of at least the ``needed`` bytes its descriptor fills or reads, else refused
    naming ``reserve`` (as the caller spells it: the training forward's ``out[3]``)."""
    if desc is None:
        return None
    if not desc.is_contiguous():
        raise InfiniError(Status.BAD_TENSOR_STRIDES, "reserve must be one packed buffer")
    nbytes = desc.numel * ITEMSIZE[desc.dtype]
    if nbytes < needed:
        raise InfiniError(
            Status.INSUFFICIENT_WORKSPACE,
            f"reserve holds {nbytes} bytes; this problem needs {needed}",
        )
    return nbytes


def out_arrays(out: Any, names: tuple[str, ...], optional: int = 0) -> tuple[Any, ...]:
    """``out=``: a tuple with one array (or None: allocate it) per output of ``names``, of
    which the last ``optional`` may be left out; returned with every entry."""
    if out is None:
        return (None,) * len(names)
    shortest = len(names) - optional
    # Its items, taken once: a subclass's len() need not count what its iteration yields.
    given = tuple(out) if isinstance(out, tuple | list) else None
    if given is None or not shortest <= len(given) <= len(names):
        count = str(len(names)) if not optional else f"{shortest} to {len(names)}"
        raise InfiniError(
            Status.BAD_PARAM,
            f"out must be a tuple of {count} arrays or None ({', '.join(names)}); "
            f"got {type(out).__name__}" + ("" if given is None else f" of length {len(given)}"),
        )
    return (*given, *(None,) * (len(names) - len(given)))
