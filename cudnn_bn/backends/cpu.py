"""The CPU backend: every batch-norm pass on host pointers, two walks over the data.

Each kernel object is built once per descriptor: it works out how to walk its tensors
(``cpu_layout.Layout``), the per-channel operands' strides and dtypes, and whether a call is
large enough for threads; a call then only hands the pointers to the compiled pass
(``cpu_kernels``): per-channel sums in one read of the data, then the results in one more
read and one write. A small call is one kernel call in the calling thread; a large one runs
the same steps with its work items on the engine's threads (``cpu_pool``). Fused passes
(``Fusion``) apply the same maths as cuDNN: ``y = relu(bn(x) [+ z])`` forward, and backward
through the ReLU mask ``output > 0``.

Aliasing: an output may be the very tensor of an input (same address and strides, e.g.
``grad_input`` over ``grad_output``): each element is read before it is written. An output
that overlaps an input any other way is computed into a scratch buffer and copied at the
end, so the result is what it would be without the overlap.
"""

from collections.abc import Callable
from functools import partial
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
from numba.core import config

from ..address_tests import compiled_test, meeting
from ..dtypes import FLOAT_TYPES
from ..enums import DataType, Status
from ..errors import InfiniError
from ..problems import (
    BackwardAttributes,
    BackwardPointers,
    BackwardTensors,
    ForwardInferenceAttributes,
    ForwardInferencePointers,
    ForwardInferenceTensors,
    ForwardTrainingAttributes,
    ForwardTrainingPointers,
    ForwardTrainingTensors,
    Fusion,
)
from ..tensor import TensorDesc
from . import cpu_kernels, cpu_pool
from .cpu_layout import SLOTS, Layout
from .host import flat_array, host_array

# The kernels see F16 as uint16 and BF16 as int16 bits (cpu_kernels); a zero-length array
# of the storage dtype tells them which.
_LIKE = {
    DataType.F16: np.empty(0, np.uint16),
    DataType.BF16: np.empty(0, np.int16),
    DataType.F32: np.empty(0, np.float32),
    DataType.F64: np.empty(0, np.float64),
}
_BEYOND_HOST = 1 << 63  # no host address is this high (x86-64 and AArch64 user space)
PARALLEL_MIN_VALUES = 1 << 16  # below this many values a thread hand-off costs more than it saves
# Below this many values a large call runs on the calling thread alone, whatever the thread
# count. A call on threads hands its pass to the helpers once (``on_threads``); on the 2-core
# development machine, after 5 ms idle, 2 threads took 0.70-0.77x the 1-thread time at 2-4
# million values and 1.0-1.4x at 262-524 thousand (F32, every pass, NCHW and channels-last,
# session 15; 1.2-2.9x at 1-4 million before, with two hand-offs and Python between them).
# At 0.8-1 million they took 0.80-0.95x alone, but no less than one thread beside torch's
# (``benchmarks/bench_cpu.py --threads 2``), whose threads then share the cores.
THREADS_MIN_VALUES = 1 << 21
# A large call's work items: up to this many per thread, each of at least ITEM_MIN_VALUES,
# claimed one at a time (``cpu_kernels._next_item``), so that a thread that starts late or
# shares its CPU with another process does less of the work instead of holding the call up.
ITEMS_PER_THREAD = 4
ITEM_MIN_VALUES = 1 << 17
# A problem's first calls on one thread run the one-call pass's steps from Python
# (``stepwise``), until the one-call pass of its dtype is compiled (by a small problem's
# plan, ``direct``) or it has made this many: that pass's compile (0.4 s) saves 10-25 us a
# call at 65k-131k values, so a first few calls (the README's first block) do better without
# it, and a problem called more often pays it once (the sums and results are the same).
STEPWISE_CALLS = 8
_ONE_CALL_DTYPES: set[np.dtype] = set()  # the storage dtypes whose one-call pass is compiled


def _channel_args(descs: list[TensorDesc | None], x: TensorDesc) -> np.ndarray:
    """(stride, dtype code) of each per-channel tensor (``CHANNEL_SLOTS`` rows), (1, F64)
    for an absent one; the input ``x``'s first values (``FIRST_VALUES``) last."""
    descs = descs + [None] * (cpu_kernels.FIRST_VALUES - len(descs))
    rows = [(1, int(DataType.F64)) if d is None else (d.strides[0], int(d.dtype)) for d in descs]
    return np.array([*rows, (x.strides[1], int(x.dtype))], dtype=np.int64)


def _bits(*flags: bool) -> int:
    """The set of slots whose flag is true, as ``cpu_kernels.copy_channels`` takes it."""
    return sum(1 << slot for slot, flag in enumerate(flags) if flag)


# Each dtype code's NumPy storage: NumPy converts F16, F32 and F64 to and from float64 as the
# kernels do (exact reads, one rounding to nearest even); BF16 (uint16 bits) it reads exactly
# as the high half of a float32, and has no rounding to it.
_STORAGE = {int(t): f.storage for t, f in FLOAT_TYPES.items()}
_BF16 = int(DataType.BF16)


def _numpy_copy(at, args, bits, values, shift, shift_row, store) -> None:
    """``cpu_kernels.copy_channels`` by NumPy (its compile was 0.46 s of the README block's
    4.9 s), the compiled one where it writes a BF16 tensor."""
    slots = [t for t in range(len(at)) if bits >> t & 1]
    if store and any(args[t, 1] == _BF16 for t in slots):
        cpu_kernels.copy_channels(at, args, bits, values, shift, shift_row, store)
        return
    count = values.shape[1]
    for t in slots:
        stride, code = int(args[t, 0]), int(args[t, 1])
        storage = _STORAGE[code]
        span = flat_array(int(at[t]), (count - 1) * stride + 1, storage)
        view = np.lib.stride_tricks.as_strided(span, (count,), (stride * storage.itemsize,))
        # NumPy's casts flag what the compiled copy ignores: a result beyond the dtype's
        # range (stored as inf), and a signaling NaN read from an F32 or BF16 tensor (made
        # quiet), "invalid value encountered in cast", a warning or, under the caller's
        # ``np.seterr(all="raise")``, an error
        with np.errstate(all="ignore"):
            if store:
                view[...] = values[t]
            elif code == _BF16:
                values[t] = (view.astype(np.uint32) << 16).view(np.float32)
            else:
                values[t] = view
    if shift_row >= 0:  # x's first values as 0 where not finite (``copy_channels``)
        tiled = np.tile(values[shift_row], shift.size // count)
        finite = shift_row != cpu_kernels.FIRST_VALUES or np.isfinite(tiled)
        shift[:] = np.where(finite, tiled, 0.0)


def _interpreted_results(*args) -> None:
    """``cpu_kernels.channel_results``' Python function on ``args`` (NumPy arrays and
    scalars), warnings of NumPy's floating-point errors off (the kernels' error model: 1/0
    is inf): its compile was 0.55 s of the README block's 4.9 s. Its float64 operations are
    the compiled ones (IEEE, no contraction), so are the results."""
    with np.errstate(all="ignore"):
        cpu_kernels.channel_results.py_func(*args)


# A process's first calls step by step (``stepwise``) make their per-channel steps in NumPy
# and the interpreter (``_numpy_copy``, ``_interpreted_results``), until those have taken
# this many columns (channels times tile, over all calls; about 8 us each, so 70 ms at
# most): the README's first block then compiles no per-channel step (1 s of its 4.9 s,
# 0.5 ms more a call at C = 64), and a process that makes more such calls compiles them once.
INTERPRETED_COLUMNS = 1 << 13
_interpreted_columns = [0]  # taken so far


def _per_channel_steps(columns: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """The per-channel copy and results for a call of ``columns`` (``INTERPRETED_COLUMNS``):
    NumPy's and the interpreter's while the process's budget lasts, else the compiled ones."""
    if _interpreted_columns[0] + columns > INTERPRETED_COLUMNS:
        return cpu_kernels.copy_channels, cpu_kernels.channel_results
    _interpreted_columns[0] += columns
    return _numpy_copy, _interpreted_results


class _HostKernel:
    """What the three passes share: the walk, the overlap rule, the thread count."""

    engine = "numpy"
    workspace_size = 0
    reserve_size = 0
    # Slots of ``data`` (the layout's tensors) that are outputs, and those that are inputs.
    outputs: tuple[int, ...]
    inputs: tuple[int, ...]
    # The pass (``cpu_kernels.channel_results``' kind), the backward's mode, the momentum.
    kind: int
    mode: int = cpu_kernels.TRAIN
    momentum = 0.0
    # Per-channel slots read and written (bits, ``_bits``); the one whose values (tiled)
    # shift the sums (none: -1); the first of the sums the pass uses (``item_sums_*``).
    reads: int
    writes: int = 0
    shift_row: int = cpu_kernels.FIRST_VALUES
    first_sum: int = 0
    # The elementwise pass's flags (the forward's two, then two unset; the backward's four).
    flags: tuple[bool, bool, bool, bool]
    # The steps a one-call pass makes (``cpu_kernels.entries``' slots), and their addresses.
    step_slots: tuple[int, ...]
    _plan: np.ndarray | None = None
    _whole: Callable[..., None] | None = None  # one_call()
    _stepwise = 0  # calls made step by step (``STEPWISE_CALLS``)
    # The operator's pointer tuple, and its fields that fill the data slots, then the
    # per-channel ones (None: NULL).
    pointer_type: type[NamedTuple]
    data_fields: tuple[str | None, ...]
    channel_fields: tuple[str | None, ...]

    def __init__(self, data: list[TensorDesc | None], channel: list[TensorDesc | None]) -> None:
        if config.DISABLE_JIT:  # the kernels are numba intrinsics: nothing runs uncompiled
            raise InfiniError(
                Status.NOT_IMPLEMENTED,
                "the CPU engine compiles its kernels with numba, and NUMBA_DISABLE_JIT=1 turns "
                "numba's compiler off: unset NUMBA_DISABLE_JIT",
            )
        cpu_kernels.warn_once()
        self.data = data
        self.layout = Layout.of(data)
        self.spans = np.zeros(SLOTS, dtype=np.int64)  # absent slots: empty
        self.spans[: len(data)] = self.layout.spans
        self.channel_args = _channel_args(channel, data[0])
        self.like = _LIKE[data[0].dtype]
        itemsize = FLOAT_TYPES[data[0].dtype].itemsize
        self.nbytes = [span * itemsize for span in self.layout.spans]
        self.numel = self.layout.count * self.layout.channels  # of each data tensor
        self.parallel = self.numel >= PARALLEL_MIN_VALUES
        self._items: dict[int, np.ndarray] = {}  # work_items
        self._blocks: dict[int, np.ndarray] = {}  # blocks, by thread count
        self.absent = (0,) * (SLOTS - len(data))  # the data slots this pass has not
        self.channels_absent = (0,) * (cpu_kernels.FIRST_VALUES - len(channel))
        # The fields that fill the data slots, None for a slot this problem leaves empty
        # (a field given anyway is not read).
        self.slot_fields = tuple(
            f if d is not None else None for f, d in zip(self.data_fields, data, strict=True)
        )
        self._data_at, self._channel_at = (
            self._picker(self.slot_fields),
            self._picker(self.channel_fields),
        )
        self.tile = int(self.layout.geometry[cpu_kernels.TILE])
        # The item kernels of this layout's walk (the other is never compiled for it).
        walk = "across" if self.layout.geometry[3] else "along"
        self.item_sums, self.item_forward, self.item_backward = (
            getattr(cpu_kernels, f"item_{step}_{walk}") for step in ("sums", "forward", "backward")
        )
        # A test of the data slots' addresses that is true where an output's bytes may meet
        # an input's (``overlapping`` then looks closer).
        self.meets = compiled_test(
            meeting(
                [
                    (o, i, -self.nbytes[i], self.nbytes[o])
                    for o in self.outputs
                    for i in self.inputs
                    if data[o] is not None and data[i] is not None
                ]
            )
        )
        # Output slots whose layout equals an input's: the same address is safe for those.
        self.same_layout = {
            (o, i)
            for o in self.outputs
            for i in self.inputs
            if data[o] is not None and data[i] is not None and data[o].strides == data[i].strides
        }

    def plan(self) -> np.ndarray:
        """``cpu_kernels.whole_pass``'s plan: this pass's fixed arguments, the addresses
        of its steps, looked up on its first call, and its blocks on one thread."""
        if self._plan is None:
            k, layout = cpu_kernels, self.layout
            steps = k.entries(self.like, layout.geometry, layout.strides, self.step_slots)
            blocks = self.blocks(1)
            fields = (self.kind, self.reads, self.writes, self.shift_row, self.mode,
                      self.first_sum, len(blocks), self.scratch_size)  # fmt: skip
            parts = (fields, self.flags, layout.geometry, self.spans)
            arrays = (self.channel_args.ravel(), layout.strides.ravel(), steps, blocks.ravel())
            self._plan = np.concatenate([*parts, *arrays]).astype(np.int64)
            assert self._plan.size == k.PLAN_SIZE + blocks.size
        return self._plan

    @property
    def scratch_size(self) -> int:
        """The float64 scratch one call of this pass takes (``cpu_kernels.scratch_size``:
        per-channel values, tiled shift, sums, coefficients), for its layout and kind."""
        return cpu_kernels.scratch_size(self.layout.channels, self.tile, self.kind)

    def blocks(self, threads: int) -> np.ndarray:
        """The blocks of channels ``cpu_kernels.blocks_pass`` walks on ``threads`` threads
        (an items table): about ``BLOCK_BYTES`` of data each where a pass with sums runs
        along channels (otherwise one block, the whole tensor), and on more than one thread
        at least ``ITEMS_PER_THREAD`` a thread (``on_threads``)."""
        found = self._blocks.get(threads)
        if found is None:
            k, count = cpu_kernels, 1
            if self.kind != k.INFERENCE and not self.layout.geometry[3]:
                data = self.numel * self.like.itemsize * np.count_nonzero(self.spans)
                count = data // k.BLOCK_BYTES
            if threads > 1:
                count = max(count, threads * ITEMS_PER_THREAD)
            count = min(max(count, 1), self.layout.channels)
            found = self._blocks[threads] = self.layout.items(count)
        return found

    def launch(self, at: list[int] | tuple[int, ...], channel: tuple[int, ...]) -> None:
        """The pass on the data slots' addresses ``at`` and the per-channel tensors'
        ``channel``: one call in this thread (``cpu_kernels.whole_pass``) for a small
        problem (its first calls step by step: ``STEPWISE_CALLS``), else on the engine's
        threads (``on_threads``)."""
        values = self.numel
        threads = cpu_pool.thread_count() if self.parallel else 1
        if threads > 1 and values >= THREADS_MIN_VALUES:
            cpu_pool.wake()
            self.on_threads(at, channel, threads)
            return
        whole = self._whole
        if whole is None:
            if self._stepwise < STEPWISE_CALLS and self.like.dtype not in _ONE_CALL_DTYPES:
                self._stepwise += 1
                self.stepwise(at, channel)
                return
            whole = self.one_call()
        whole(*at, *self.absent, *channel, *self.channels_absent)

    def by_blocks(self, threads: int) -> bool:
        """Whether ``threads`` threads take blocks of channels (``blocks_pass``): runs stay
        in one channel, and there are channels for ``ITEMS_PER_THREAD`` blocks a thread."""
        return not self.layout.geometry[3] and self.layout.channels >= threads * ITEMS_PER_THREAD

    def on_threads(
        self, at: list[int] | tuple[int, ...], channel: tuple[int, ...], threads: int
    ) -> None:
        """The pass on ``threads`` threads, one hand-off to the helpers: blocks of channels
        (``cpu_kernels.blocks_pass``, the results of one thread bit for bit) where they fit
        (``by_blocks``), otherwise work items of rows too (``cpu_kernels.rows_pass``)."""
        k, plan = cpu_kernels, self.plan()
        floats = np.zeros(self.scratch_size)
        channel_at, values, shift = self.channel_inputs(channel, at[0], floats, k.copy_channels)
        eps, momentum, like = self.eps, self.momentum, self.like
        views = (*self.views(at), *(like,) * len(self.absent))  # absent slots: empty
        if self.by_blocks(threads):
            items, state = self.blocks(threads), np.zeros(2, np.int64)
            done = state

            def task() -> None:
                k.blocks_pass(plan, eps, momentum, like, *views, floats, items, state)
        else:
            most = self.numel // ITEM_MIN_VALUES
            items = self.work_items(max(threads, min(threads * ITEMS_PER_THREAD, most)))
            width = 0 if self.kind == k.INFERENCE else shift.size + k.PAD
            partial = np.zeros((len(items) * k.SUMS, width))
            state = np.zeros(6, np.int64)  # each step's claim and done counts
            done = state[4:]  # the elementwise pass's: the last step

            def task() -> None:
                k.rows_pass(plan, eps, momentum, like, *views, floats, partial, items, state)

        cpu_pool.team(task, len(items), done)
        k.copy_channels(channel_at, self.channel_args, self.writes, values, shift, -1, True)

    def work_items(self, count: int) -> np.ndarray:
        """``Layout.items(count)``, made once per count (on every large call it cost about
        20 us after the machine idled)."""
        items = self._items.get(count)
        if items is None:
            items = self._items[count] = self.layout.items(count)
        return items

    def views(self, addresses: list[int]) -> list[np.ndarray]:
        """Flat arrays over the data slots (what the item kernels take)."""
        spans, storage = self.layout.spans, self.like.dtype
        return [flat_array(a, n, storage) for a, n in zip(addresses, spans, strict=True)]

    def channel_inputs(
        self, channel: tuple[int, ...], x: int, floats: np.ndarray, copy: Callable[..., None]
    ) -> tuple:
        """The per-channel addresses ``channel`` (and the input's, ``x``) as an array, and
        the views of ``floats`` (``cpu_kernels.scratch_size``) that hold the float64 table
        of those read and the sums' tiled shift (``shift_row``), made
        (``copy``: ``cpu_kernels.copy_channels`` or ``_numpy_copy``)."""
        k, channels = cpu_kernels, self.layout.channels
        at = np.zeros(k.CHANNEL_SLOTS, dtype=np.int64)
        at[: len(channel)], at[k.FIRST_VALUES] = channel, x
        o = k.CHANNEL_SLOTS * channels
        values = floats[:o].reshape(k.CHANNEL_SLOTS, channels)
        shift = floats[o : o + channels * self.tile]
        copy(at, self.channel_args, self.reads, values, shift, self.shift_row, False)
        return at, values, shift

    def channel_results(self, at, values, sums, shift, steps):
        """Write the per-channel results; the elementwise pass's tiled coefficients (``steps``:
        ``_per_channel_steps``)."""
        copy, results = steps
        coefficients = np.empty((3, self.layout.channels * self.tile))
        narrow = self.like.itemsize < 8  # F32/F16/BF16 data
        results(self.kind, sums, shift, values, np.int64(self.layout.count), self.eps,
                self.momentum, self.mode, narrow, coefficients, 0,
                self.layout.channels)  # fmt: skip
        copy(at, self.channel_args, self.writes, values, shift, -1, True)
        return coefficients

    def stepwise(self, at: list[int] | tuple[int, ...], channel: tuple[int, ...]) -> None:
        """``blocks_pass``'s steps on one block, the whole tensor, called from Python: a
        problem's first calls (``STEPWISE_CALLS``) compile no pass of their own."""
        k, layout, like, kind = cpu_kernels, self.layout, self.like, self.kind
        geometry, strides, flags = layout.geometry, layout.strides, self.flags
        steps = _per_channel_steps(layout.channels * self.tile)
        floats = np.zeros(self.scratch_size)
        channel_at, values, shift = self.channel_inputs(channel, at[0], floats, steps[0])
        x, a, y, gi, gz = (*self.views(at), *(like,) * len(self.absent))  # absent: empty
        item, state = self.work_items(1), np.zeros(2, np.int64)
        sums = np.zeros((k.SUMS, 0 if kind == k.INFERENCE else shift.size + k.PAD))
        if kind != k.INFERENCE:  # a training forward's sums are x's alone
            dy, out = (a, y) if kind == k.BACKWARD else (like, like)
            self.item_sums(x, dy, out, geometry, strides, shift, sums, self.first_sum, item, state)
        k_0, k_1, k_2 = self.channel_results(channel_at, values, sums, shift, steps)
        state[:] = 0
        if kind != k.BACKWARD:
            self.item_forward(x, a, y, geometry, strides, k_0, k_1, k_2, flags[:2], item, state)
        elif flags[2] or flags[3]:
            self.item_backward(x, a, y, gi, gz, geometry, strides, k_0, k_1, k_2, flags, item,
                               state)  # fmt: skip

    def overlapping(self, addresses: list[int]) -> list[int]:
        """Output slots that overlap an input other than element for element."""
        found = []
        for o in self.outputs:
            start, end = addresses[o], addresses[o] + self.nbytes[o]
            if not start:
                continue
            for i in self.inputs:
                other = addresses[i]
                if (other and other < end and start < other + self.nbytes[i]) and not (
                    other == start and (o, i) in self.same_layout
                ):
                    found.append(o)
                    break
        return found

    def run(self, ptrs: Any, workspace: int, stream: int) -> None:
        """The pass on ``ptrs`` (``workspace``/``stream`` are unused), outputs that overlap
        an input written through scratch."""
        if max(ptrs) >= _BEYOND_HOST:  # the kernels take int64 addresses
            value, name = max(zip(ptrs, ptrs._fields, strict=True))
            raise InfiniError(Status.BAD_PARAM, f"{name} is {value:#x}, not a host address")
        addresses, channel = self.pointers(ptrs)
        clashes = self.overlapping(addresses) if self.meets(addresses) else ()
        if not clashes:
            self.launch(addresses, channel)
            return
        storage = FLOAT_TYPES[self.data[0].dtype].storage
        scratch = {o: np.empty(self.layout.spans[o], dtype=storage) for o in clashes}
        at = [scratch[s].ctypes.data if s in scratch else a for s, a in enumerate(addresses)]
        self.launch(at, channel)
        for o, buffer in scratch.items():
            desc = self.data[o]
            host_array(addresses[o], desc)[...] = host_array(buffer.ctypes.data, desc)

    def run_disjoint(self, ptrs: Any, workspace: int, stream: int) -> None:
        """``run`` where the caller has made sure no output overlaps an input and every
        absent tensor's pointer is NULL."""
        self.launch(*self.pointers(ptrs))

    def _fields(self) -> tuple[str | None, ...]:
        """The pointer fields ``whole_pass`` takes, in order (None: NULL), after its fixed
        arguments (``_fixed``)."""
        return (*self.slot_fields, *(None,) * len(self.absent), *self.channel_fields,
                *(None,) * len(self.channels_absent))  # fmt: skip

    def _fixed(self) -> tuple:
        return self.plan(), self.eps, self.momentum, self.like

    def one_call(self) -> Callable[..., None]:
        """``whole_pass`` of this problem with its fixed arguments bound, called through its
        compiled entry point (``cpu_kernels.python_entry``: no dispatcher typing of its 15
        arguments, 1.2 us of a small call) on the addresses of ``_fields``, all ints."""
        if self._whole is None:
            fixed = self._fixed()
            count = len(self._fields())
            entry = cpu_kernels.python_entry(cpu_kernels.whole_pass, *fixed, *(0,) * count)
            self._whole = partial(entry, *fixed)
            _ONE_CALL_DTYPES.add(self.like.dtype)
        return self._whole

    def direct(self) -> tuple[tuple[str | None, ...], Callable[..., None]] | None:
        """``run_disjoint`` of a problem of one call, as ``one_call()`` on the pointers of the
        fields it takes (``(fields, call)``: ``ops.descriptor.Launch``, whose ``call`` takes
        those pointers as its arguments); None for a larger problem."""
        return None if self.parallel else (self._fields(), self.one_call())

    def batched(
        self, count: int, steps: dict[str | None, int]
    ) -> tuple[tuple[str | None, ...], Callable[[tuple, int, int], None]] | None:
        """``direct()`` of ``count`` problems of this layout, problem ``b``'s pointers the
        given ones plus ``b * steps[field]`` bytes (``cpu_kernels.batch_pass``: one call,
        no copies), blocks of problems on the engine's threads where the batch has as many
        values as a threaded problem; None where each problem is large itself."""
        if self.parallel:
            return None
        fields, fixed, k = self._fields(), self._fixed(), cpu_kernels
        whole = k.entry(k.whole_pass, *fixed, *(0,) * len(fields))
        offsets = np.array([steps.get(f, 0) for f in fields], dtype=np.int64)
        fixed = (whole, *fixed, offsets)
        parallel = count * self.numel >= PARALLEL_MIN_VALUES
        blocks: dict[int, np.ndarray] = {}  # work items (blocks of problems), by their count

        def call(values: tuple, workspace: int, stream: int) -> None:
            chunks = min(count, cpu_pool.thread_count()) if parallel else 1
            items = blocks.get(chunks)
            if items is None:
                bounds = [(i * count // chunks, (i + 1) * count // chunks) for i in range(chunks)]
                items = blocks[chunks] = np.array(bounds, np.int64)
            state = np.zeros(2, np.int64)
            cpu_pool.team(lambda: k.batch_pass(*fixed, items, state, *values), chunks, state)

        return fields, call

    def _picker(self, fields: tuple[str | None, ...]) -> Callable[[tuple], tuple]:
        """The values of ``fields`` from a pointer tuple with a 0 appended (None: that 0)."""
        index = {f: i for i, f in enumerate(self.pointer_type._fields)}
        null = len(index)
        return itemgetter(*(null if f is None else index[f] for f in fields))

    def pointers(self, ptrs: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The data slots' addresses and the per-channel tensors'."""
        values = (*ptrs, 0)
        return self._data_at(values), self._channel_at(values)


class BatchNormBackward(_HostKernel):
    """Batch-norm backward (all modes, fused or not, any output mask).

    Data slots: input, grad_output, output (fused), grad_input, grad_z."""

    outputs, inputs = (3, 4), (0, 1, 2)
    pointer_type = BackwardPointers
    data_fields = ("input", "grad_output", "output", "grad_input", "grad_z")
    channel_fields = ("weight", "running_mean", "running_var", "grad_weight", "grad_bias")

    def __init__(
        self, tensors: BackwardTensors, attributes: BackwardAttributes, device_id: int = 0
    ) -> None:
        self.tensors, self.attributes = tensors, attributes
        a, t = attributes, tensors
        fused = a.fusion != Fusion.BN
        with_z = a.fusion == Fusion.BN_ADD_RELU
        data = [t.input, t.grad_output, t.output if fused else None]
        data += [t.grad_input if a.output_mask[0] else None, t.grad_z if with_z else None]
        reads_stats = a.mode.reads_statistics
        channel = [t.weight, t.running_mean if reads_stats else None]
        channel += [t.running_var if reads_stats else None, t.grad_weight, t.grad_bias]
        super().__init__(data, channel)
        k = cpu_kernels
        self.kind, self.mode, self.eps = k.BACKWARD, int(a.mode), float(a.eps)
        train = self.mode == k.TRAIN  # the sums' shift: x's first values, else the mean
        self.reads = _bits(True, reads_stats, reads_stats, False, False, False, train)
        self.writes = _bits(False, False, False, *a.output_mask[1:])
        self.shift_row = k.FIRST_VALUES if train else 1
        self.first_sum = 0 if train else k.DY_SUMS  # x's sums only for batch statistics
        # The elementwise pass's flags: use x (all modes but eval), mask, write gi, write gz.
        self.flags = (self.mode != k.EVAL, fused, a.output_mask[0], with_z)
        self.step_slots = (k.COPY, k.ITEM_SUMS, k.RESULTS, k.BLOCKS)
        self.step_slots += (k.ITEM_BACKWARD,) if a.output_mask[0] or with_z else ()


class BatchNormForwardTraining(_HostKernel):
    """Training-mode forward: batch statistics, output, saved statistics, running update.

    Data slots: input, z (fused add), output."""

    outputs, inputs = (2,), (0, 1)
    pointer_type = ForwardTrainingPointers
    data_fields = ("input", "z", "output")
    channel_fields = ("weight", "bias", "saved_mean", "saved_invstd", "running_mean",
                      "running_var")  # fmt: skip

    def __init__(
        self,
        tensors: ForwardTrainingTensors,
        attributes: ForwardTrainingAttributes,
        device_id: int = 0,
    ) -> None:
        self.tensors, self.attributes = tensors, attributes
        t, a = tensors, attributes
        with_z = a.fusion == Fusion.BN_ADD_RELU
        super().__init__(
            [t.input, t.z if with_z else None, t.output],
            [t.weight, t.bias, t.saved_mean, t.saved_invstd, t.running_mean, t.running_var],
        )
        k = cpu_kernels
        self.kind, self.eps, self.momentum = k.TRAINING, float(a.eps), float(a.momentum)
        self.flags = (with_z, a.fusion != Fusion.BN, False, False)  # add z, ReLU
        updates = (t.running_mean is not None, t.running_var is not None)
        self.reads = _bits(True, True, False, False, *updates, True)
        self.writes = _bits(False, False, True, True, *updates)
        self.step_slots = (k.COPY, k.ITEM_SUMS, k.RESULTS, k.ITEM_FORWARD, k.BLOCKS)


class BatchNormForwardInference(_HostKernel):
    """Inference-mode forward with fixed statistics. Data slots: input, (none), output."""

    outputs, inputs = (2,), (0,)
    pointer_type = ForwardInferencePointers
    data_fields = ("input", None, "output")
    channel_fields = ("weight", "bias", "running_mean", "running_var")

    def __init__(
        self,
        tensors: ForwardInferenceTensors,
        attributes: ForwardInferenceAttributes,
        device_id: int = 0,
    ) -> None:
        self.tensors, self.attributes = tensors, attributes
        t = tensors
        super().__init__(
            [t.input, None, t.output], [t.weight, t.bias, t.running_mean, t.running_var]
        )
        k = cpu_kernels
        self.kind, self.mode, self.eps = k.INFERENCE, k.EVAL, float(attributes.eps)
        self.reads, self.shift_row = _bits(True, True, True, True), -1
        self.flags = (False,) * 4  # the forward's: no z, no ReLU
        self.step_slots = (k.COPY, k.RESULTS, k.ITEM_FORWARD, k.BLOCKS)
