"""``batch_norm_backward_batched``: B problems as one backward call.

functorch's batching rule for batch norm (``batch_norm_batch_rule``, seed 002) folds the batch
dimension into the channels (``reshape_dim_into(bdim, 1, input)``): ``(B, N, C, ...)`` data
becomes ``(N, B*C, ...)``, per-channel operands become ``(B*C,)``, and one backward runs
every problem at once. On the host that is the CPU engine's batched pass
(``batched_host``: in place, or folded by one gather, over the shared call path). On a GPU
the arrays are folded here (a view where the strides allow, else one copy by the arrays'
own library) and one ``batch_norm_backward`` runs on them; the results are views of that
call's outputs shaped ``(B, N, C, ...)`` and ``(B, C)``. Every operand of a new problem is
checked through the door first, so B = 0 validates as much as any other batch. A repeated
problem (the same signatures and options, ``call.read``; every array read by its attributes,
all of the input's library) reuses how it folds (``_Fold``) and goes straight to folding;
the backward call keys its own plan.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from ..arrays import TORCH, Operand, common_place, operand
from ..arrays.cuda_interface import is_cupy
from ..enums import Device, Status
from ..errors import InfiniError
from ..ops.batch_norm_backward import parse_fusion, validate_tensors
from ..ops.validation import check_eps, check_output_mask
from ..problems import BackwardTensors, Fusion
from ..tensor import TensorDesc
from .backward import ALL_GRADIENTS, BACKWARD, raw_options, statistics
from .batched_host import BATCHED_HOST, check_shapes, one_problem
from .batched_host import DATA as _DATA
from .batched_host import PER_CHANNEL as _PER_CHANNEL
from .call import Aligned, options_key, read, run
from .outputs import packed_like, statistics_dtype
from .spelling import array_api
from .streams import call_place, call_stream


def _native(op: Operand, array: Any) -> Any:
    """A device operand as an array of its own library (torch or CuPy), which the copies
    below take."""
    if op.kind is TORCH or is_cupy(op.owner):
        return op.owner
    import cupy

    return cupy.asarray(array)


def _folding(name: str, desc: TensorDesc, batch: int) -> tuple[TensorDesc | None, tuple]:
    """How operand ``name`` folds: ``(copy, shape)``, ``copy`` being the packed layout it is
    first copied into (None where a view does) and ``shape`` the folded one. Data
    ``(B, N, C, ...)``, swapped to ``(N, B, C, ...)``, becomes ``(N, B*C, ...)``: a view
    where B's stride is C channel strides. A per-channel operand becomes ``(B*C,)``: the
    rows of a packed ``(B, C)`` one, else a ``(B, C)`` copy (a shared ``(C,)`` one
    repeated)."""
    if name in _DATA:
        n, channels, rest = desc.shape[1], desc.shape[2], desc.shape[3:]
        copy = TensorDesc.contiguous(desc.dtype, (n, batch, channels, *rest))
        viewed = desc.strides[0] == channels * desc.strides[2]
        return None if viewed else copy, (n, batch * channels, *rest)
    if desc.ndim == 2 and desc.is_contiguous():
        return None, (-1,)
    return TensorDesc.contiguous(desc.dtype, (batch, desc.shape[-1])), (-1,)


def _copier(
    name: str, copy: TensorDesc | None, kind: Any, like: Any
) -> Callable[[Any], Any] | None:
    """How operand ``name`` is copied where no view folds it (``_folding``'s ``copy``; None:
    a view does): data, swapped to ``(N, B, C, ...)``, by its library's packed copy (one
    call, not an allocation and an assignment); a per-channel operand into a new packed
    ``(B, C)`` array (a shared ``(C,)`` one on every row)."""
    if copy is None:
        return None
    if name in _DATA:
        return kind.packed
    allocate = kind.allocator(like, copy)

    def rows(native: Any) -> Any:
        array = allocate()
        array[...] = native
        return array

    return rows


def _no_problems(
    descs: dict[str, TensorDesc], made: Callable[[TensorDesc], Any], mask: tuple, wants_z: bool
) -> tuple[Any, ...]:
    """B = 0: the operator's own checks on one problem's layout (data ``(N, C, ...)``,
    per-channel ``(C,)``), then empty results shaped as a batch's."""
    one = {n: one_problem(n, desc) for n, desc in descs.items()}
    x = one["input"]
    w = one.get("weight") or TensorDesc.contiguous(statistics_dtype(x), x.shape[1:2])
    per_channel = TensorDesc.contiguous(w.dtype, w.shape)
    saved = "saved_mean" in one
    validate_tensors(
        BackwardTensors(
            packed_like(x), per_channel, per_channel, x, one["grad_output"], w,
            one.get("saved_mean" if saved else "running_mean"),
            one.get("saved_invstd" if saved else "running_var"),
            one.get("output"), one.get("bias"), packed_like(x) if wants_z else None,
        )
    )  # fmt: skip
    batch_shape = descs["input"].shape
    data = made(TensorDesc.contiguous(x.dtype, batch_shape))
    grads = [made(TensorDesc.contiguous(w.dtype, (0, *w.shape))) for _ in range(2)]
    wanted = (mask[0], mask[1] and "weight" in descs, mask[2])
    results = [g if m else None for g, m in zip((data, *grads), wanted, strict=True)]
    return (
        (*results, made(TensorDesc.contiguous(x.dtype, batch_shape))) if wants_z else tuple(results)
    )


@array_api
def batch_norm_backward_batched(
    input: Any,
    grad_output: Any,
    weight: Any,
    running_mean: Any,
    running_var: Any,
    *,
    saved_mean: Any = None,
    saved_invstd: Any = None,
    output: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    mode: str = "train",
    stream: Any = None,
    output_mask: tuple[bool, bool, bool] = ALL_GRADIENTS,
    fusion: str | None = None,
    persistent: bool | None = None,
) -> tuple[Any, ...]:
    """Batch-norm backward of ``B`` independent problems in one call (functorch's vmap rule).

    ``input``, ``grad_output`` (and a fused ``output``) are ``(B, N, C, ...)``; ``weight``,
    ``bias`` and the statistics are ``(C,)``, shared, or ``(B, C)``, one row per problem
    (``weight=None``: ones, no grad_weight). Returns ``grad_input`` shaped like ``input`` and
    ``grad_weight``/``grad_bias`` shaped ``(B, C)``; the other options are
    ``batch_norm_backward``'s (a fused one takes no reserve, each problem's would differ, so
    it runs where it needs none: the CuPy engine on NVIDIA).
    """
    arrays = (
        input,
        grad_output,
        output,
        weight,
        running_mean,
        running_var,
        saved_mean,
        saved_invstd,
        bias,
    )  # in _NAMES order
    raw = raw_options(mode, eps, fusion, output_mask, persistent, False)
    if type(input) is np.ndarray:  # host memory: the CPU engine's pass (no read here)
        return run(BATCHED_HOST, arrays, raw, stream)
    signatures, ptrs, others = read(arrays, _READ_ONLY, [options_key(raw)])
    try:
        key = tuple(signatures)
        fold = None if others else _folds.get(key)
    except TypeError:  # an unhashable option: validated below
        key, fold = None, None
    if fold is not None:
        return fold(arrays, stream, ptrs)
    fold, ops = _checked(arrays, raw, stream)
    like = arrays[0]
    if isinstance(fold, _Fold) and (
        others or any(type(a) is not type(like) for a in arrays if a is not None)
    ):
        # Each in its own library, over the door's operands (``ops`` keeps what they point
        # into alive: a resolved torch view, a DLPack capsule) until the call ends.
        natives = tuple(
            None if a is None else _native(ops[n], a) for n, a in zip(_NAMES, arrays, strict=True)
        )
        return fold(natives, stream)
    if key is not None:
        if len(_folds) >= _FOLDS:
            _folds.clear()
        _folds[key] = fold
    return fold(arrays, stream)  # the door checked them


_NAMES = (*_DATA, *_PER_CHANNEL)
_READ_ONLY = (False,) * len(_NAMES)  # the call writes none of its operands
_BACKWARD_OPERANDS = BACKWARD.names[: len(BACKWARD.names) - len(BACKWARD.out_names)]  # no out=
_FOLDS = 256  # problems remembered; all are forgotten at once beyond this
_folds: dict[tuple, "_Fold"] = {}


def _checked(
    arrays: tuple, raw: tuple, stream: Any
) -> tuple["_Fold | _OnHost", dict[str, Operand]]:
    """Every check on a new problem, through the door: its fold and the operands, or on the
    host the CPU engine's pass (which checks them itself)."""
    mode, eps, fusion, output_mask, *_ = raw
    given = dict(zip(_NAMES, arrays, strict=True))
    statistics(mode, *(given[n] for n in _PER_CHANNEL[1:5]))
    check_eps(eps)
    mask = check_output_mask(output_mask)
    wants_z = parse_fusion(fusion) == Fusion.BN_ADD_RELU
    for name in ("input", "grad_output"):
        if given[name] is None:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")
    present = {n: a for n, a in given.items() if a is not None}
    device, device_id = common_place(present)
    if device == Device.CPU:
        return _OnHost(raw), {}
    call_on = call_stream(stream, given["input"], device, device_id)
    ops = {n: operand(n, a, call_on) for n, a in present.items()}
    descs = {n: op.desc for n, op in ops.items()}
    sizes = check_shapes(descs)
    like = given["input"]
    fold = _Fold(descs, ops["input"].kind, like, device, device_id, sizes, mask, wants_z, raw)
    return fold, ops


class _OnHost:
    """A batch of host memory: the CPU engine's pass (``batched_host``) on the arrays, with
    the call's options ``raw`` (part of the key it is found by)."""

    def __init__(self, raw: tuple) -> None:
        self.raw = raw

    def __call__(self, arrays: tuple, stream: Any, ptrs: list[int] | None = None) -> tuple:
        return run(BATCHED_HOST, arrays, self.raw, stream)


class _Fold:
    """A checked batched problem: the layouts of its operands, where it runs, its options,
    how each operand folds (``_folding``); a call folds its arrays (each in the input's
    library), runs one backward and unfolds the results. A call with the arrays' pointers
    checks them as the door would (an operand that is copied to fold it is not seen by the
    backward's own checks)."""

    names, spelling = _NAMES, {}  # for Aligned.check

    def __init__(
        self,
        descs: dict[str, TensorDesc],
        kind: Any,
        like: Any,
        device: Device,
        device_id: int,
        sizes: tuple[int, int],
        mask: tuple,
        wants_z: bool,
        raw: tuple,
    ) -> None:
        self.descs, self.kind, self.device, self.device_id = descs, kind, device, device_id
        (self.batch, self.channels), self.mask, self.wants_z = sizes, mask, wants_z
        self.raw = raw
        self.aligned = Aligned({_NAMES.index(n): desc for n, desc in descs.items()})
        self.foldings = {}  # name -> (index in the arrays, its copy or None, shape)
        for n, desc in descs.items():
            copy, shape = _folding(n, desc, self.batch)
            self.foldings[n] = (_NAMES.index(n), _copier(n, copy, kind, like), shape)

    def __call__(
        self, natives: tuple, stream: Any, ptrs: list[int] | None = None
    ) -> tuple[Any, ...]:
        like, kind, batch = natives[0], self.kind, self.batch
        if ptrs is not None:
            self.aligned.check(ptrs, natives, self)
        call_on, scope = call_place(stream, like, kind, self.device, self.device_id)
        with scope:
            if batch == 0:  # nothing to compute: checked as one problem, empty results

                def made(desc: TensorDesc) -> Any:
                    return kind.allocator(like, desc)()

                return _no_problems(self.descs, made, self.mask, self.wants_z)
            folded = {}
            for name, (at, copy, shape) in self.foldings.items():
                native = natives[at].swapaxes(0, 1) if name in _DATA else natives[at]
                if copy is not None:
                    native = copy(native)
                folded[name] = native.reshape(shape)
            # ``batch_norm_backward`` on the folded arrays, its options made once (``raw``).
            grads = run(
                BACKWARD,
                tuple(map(folded.get, _BACKWARD_OPERANDS)),
                self.raw,
                None if stream is None else call_on,
            )
        x = self.descs["input"].shape
        data_shape = (x[1], batch, self.channels, *x[3:])
        unfolded = [
            None if g is None else g.reshape(data_shape).swapaxes(0, 1)
            for g in (grads[0], *grads[3:])
        ]
        per_channel = [None if g is None else g.reshape(batch, self.channels) for g in grads[1:3]]
        if self.wants_z:
            return (unfolded[0], *per_channel, *unfolded[1:])
        return (unfolded[0], *per_channel)
