"""The batched backward on the CPU engine, in place: ``B`` problems walked where they lie.

``(B, N, C, ...)`` data cannot be folded into ``(N, B*C, ...)`` by a view unless ``N`` is 1,
and copying it in and out cost more than the compute (three copies of the data around a
pass that reads it twice). Here the batch is a pass of its own over the shared call path
(``call.run``): its plan holds one problem's backward descriptor (``(N, C, ...)``, the
per-channel operands ``(C,)``: the rows of ``(B, C)`` ones or a shared one), validated by
the backward's own build, and launches it on all ``B`` problems at once at pointer offsets
(``OperatorDescriptor.launcher``'s ``batch``: the CPU kernel's ``batched()``, one call).
Outputs are allocated batch outermost, each problem's block laid out as the backward lays
out one problem's.
"""

from typing import Any

from ..problems import BackwardTensors
from ..runtime import Handle
from ..tensor import ITEMSIZE, TensorDesc
from .backward import BACKWARD
from .call import Built

DATA = ("input", "grad_output", "output")
PER_CHANNEL = ("weight", "running_mean", "running_var", "saved_mean", "saved_invstd", "bias")
# Each problem at least this many values: in place. A smaller one is folded with copies
# (``batched``): the kernel's fixed cost per problem (about 0.7 us: its per-channel steps
# and calls) is more than copying it costs.
MIN_VALUES = 1024


def one_problem(name: str, desc: TensorDesc) -> TensorDesc:
    """One problem's layout of batched operand ``name``: data ``(N, C, ...)`` and ``(B, C)``
    per-channel rows without the batch axis; a shared ``(C,)`` one as it is."""
    if name in DATA or desc.ndim == 2:
        return TensorDesc(desc.dtype, desc.shape[1:], desc.strides[1:])
    return desc


def in_place(descs: dict[str, TensorDesc]) -> bool:
    """Whether a batched problem (its operands' layouts, ``B`` > 0) runs in place: each
    problem has values, ``MIN_VALUES`` or more, and no stride is negative (the backward
    refuses those; folding copies them)."""
    x = descs["input"]
    return 0 < x.numel >= MIN_VALUES * x.shape[0] and all(
        s >= 0 for desc in descs.values() for s in desc.strides
    )


class _Batch:
    """One problem's descriptor launched on ``count`` of them (``steps``: bytes between
    problems, by the launch's fields); everything else is the descriptor's."""

    def __init__(self, one: Any, count: int, steps: dict[str | None, int]) -> None:
        self.one, self.count, self.steps = one, count, steps

    def launcher(self, *args: Any) -> Any:
        """The descriptor's ``launcher`` for the whole batch."""
        return self.one.launcher(*args, batch=(self.count, self.steps))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.one, name)

    def __exit__(self, *exc_info: object) -> None:
        self.one.__exit__(*exc_info)


class BatchedInPlace:
    """The pass (``call.Pass``): the batched backward's operands, no ``out=``, the
    backward's options."""

    name = "backward_batched"
    names = (*DATA, *PER_CHANNEL)
    out_names: tuple[str, ...] = ()
    out_optional = 0
    written: frozenset[str] = frozenset()
    writes = (False,) * len(names)
    spelling: dict[str, str] = {}  # noqa: RUF012 (read only)

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple:
        return BACKWARD.options(raw, arrays)

    def build(self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple) -> Built:
        count = descs["input"].shape[0]
        one = dict.fromkeys(BACKWARD.names)
        one |= {n: one_problem(n, d) for n, d in descs.items() if d is not None}
        built = BACKWARD.build(handle, one, options)
        steps = {n: _step(d) for n, d in descs.items() if d is not None and d.ndim > 1}
        outputs = {  # each problem's block as the backward lays it out, B outermost
            n: TensorDesc(d.dtype, (count, *d.shape), (d.numel, *d.strides))
            for n, d in built.outputs.items()
        }
        steps |= {n: _step(d) for n, d in outputs.items()}
        fields = {f: built.pointers.get(f, f) for f in BackwardTensors._fields}
        by_field = {f: steps[n] for f, n in fields.items() if n in steps}
        return Built(
            _Batch(built.descriptor, count, by_field),
            built.pointers,
            outputs,
            built.returns,
            built.constants,
        )

    def result(self, returned: tuple) -> tuple:
        return returned


def _step(desc: TensorDesc) -> int:
    """Bytes from one problem to the next in batched ``desc``."""
    return desc.strides[0] * ITEMSIZE[desc.dtype]


BATCHED_IN_PLACE = BatchedInPlace()
