"""Fuzz target: every array-API entry point (``test_fuzz.py`` runs it in a child process).

``batch_norm_backward``, ``batch_norm_backward_batched``, ``batch_norm_forward_training``,
``batch_norm_forward_inference``, the four ``cupyx_compat`` functions and ``fold_conv_bn``
get a random problem whose every array argument is drawn in some form: NumPy or torch of a
float dtype (or an integer, bool or complex one), a list, a scalar, None, a string, a
strided, reversed, Fortran-ordered, broadcast, read-only or ``frombuffer`` view, a 0-d
array, or a producer (``producers.py``: array interfaces, CUDA array interfaces and DLPack
producers that lie about one thing or none, byte-swapped and bfloat16 arrays, torch views
with the negative or conjugate bit, torch and NumPy subclasses, masked arrays); sometimes
two arguments are one array, the batch (N) or the batch of problems (B) is empty (a batch
runs folded or in place, as drawn, whatever its size), weight or bias is None
(affine=False), the input holds NaN, or ``out=`` arrays are given (good, read-only, aliased,
of a wrong shape, dtype, byte order or kind); scalars (eps, momentum, decay, mode,
output_mask, cupyx_compat's flags) come as Python or NumPy values, good or bad. A "clean"
problem (plain NumPy or torch arrays, good scalars) must be accepted; one that is clean but for a
producer whose method raises (its own exception, or a library's it calls: ``json``, NumPy,
a builtin) must let exactly that exception through, not refuse it. Some problems are called twice
with the same signature but one property that must still be checked on the plan's hit
(``twin``).

Invariants: a call either returns or raises an ``InfiniError`` that is not INTERNAL_ERROR
(or the very exception a producer's own method raised: the caller's, which the package lets
through, ``errors.raised_by_caller``); a failed call leaves every argument's memory as it was
(and a successful one every input it only reads); a successful one returns arrays of the
input's kind (the ``out=`` arrays where given) equal to PyTorch's float64 results (NaN
where torch has NaN) within ``helpers.TOL``, updates the running statistics as torch does,
and wrote no operand that cannot be written in place (read-only, a view with torch's
negative bit, a DLPack copy); it accepted no producer that lies or claims device memory,
and touched CUDA for none while host arrays were among its arguments; descriptors do not
outlive the cache.
"""

import gc
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from fuzzing import COUNTS, SETTINGS, child_main, problem_values, violation
from helpers import TOL, reference
from hypothesis import given
from hypothesis import strategies as st
from producers import Marks, produce, raising

import cudnn_bn
from cudnn_bn import InfiniError, Status
from cudnn_bn import cupyx_compat as cupyx
from cudnn_bn.api import batched_pass
from cudnn_bn.ops.descriptor import OperatorDescriptor

FORMS = [
    "numpy", "numpy", "numpy", "numpy", "torch", "torch", "f16", "int", "bool", "complex",
    "list", "scalar", "none", "str", "strided", "reversed", "fortran", "readonly",
    "frombuffer", "zero_d", "broadcast", "producer", "producer", "producer",
]  # fmt: skip
GOOD_FORMS = ["numpy", "torch", "strided", "reversed", "fortran", "readonly", "frombuffer"]
PRODUCED_FROM = ["numpy", "strided", "reversed", "fortran", "readonly", "frombuffer"]
ENTRY_POINTS = [
    "backward", "backward_saved", "batched", "training", "inference",
    "cupyx_training", "cupyx_inference", "cupyx_backward", "fold",
]  # fmt: skip
AFFINE_OPTIONAL = ("backward", "backward_saved", "batched", "training", "inference")
OUTPUTS = {"backward": 3, "training": 3, "inference": 1}  # entry points taking out=
OUT_FORMS = ["good", "good", "partial", "readonly", "alias_input", "alias_each_other",
             "wrong_shape", "wrong_dtype", "big_endian", "wrong_kind"]  # fmt: skip
# The training forward's out[3], its reserve (the CPU engine needs no bytes of it)
RESERVE_FORMS = ["good", "good", "empty", "strided", "readonly", "alias_output"]
IN_PLACE_MIN_VALUES = batched_pass.MIN_VALUES
TWINS = ["misaligned", "readonly_written", "overlap", "bool_option", "bad_stream"]


def arrange(values: np.ndarray, form: str, dtype) -> object:
    """``values`` as an argument of ``form`` (all but "producer")."""
    if form == "torch":
        return torch.from_numpy(values.astype(dtype))
    simple = {
        "f16": lambda: values.astype(np.float16),
        "int": lambda: values.astype(np.int32),
        "bool": lambda: values > 0,
        "complex": lambda: values.astype(np.complex64),
        "list": values.tolist,
        "scalar": lambda: float(values.flat[0]) if values.size else 1.0,
        "none": lambda: None,
        "str": lambda: "array",
        "zero_d": lambda: np.asarray(1.0, dtype),
        "fortran": lambda: np.asfortranarray(values.astype(dtype)),
        "reversed": lambda: np.ascontiguousarray(values[..., ::-1]).astype(dtype)[..., ::-1],
        "frombuffer": lambda: np.frombuffer(values.astype(dtype).tobytes(), dtype).reshape(
            values.shape
        ),
        "broadcast": lambda: np.broadcast_to(
            np.asarray(values.flat[0] if values.size else 0, dtype), values.shape
        ),
    }
    if form in simple:
        return simple[form]()
    array = values.astype(dtype)
    if form == "strided" and values.ndim:
        wide = np.zeros((*values.shape[:-1], 2 * values.shape[-1]), dtype)
        wide[..., ::2] = array
        return wide[..., ::2]
    if form == "readonly":
        array.flags.writeable = False
    return array


def snapshot(a, marks: Marks | None = None) -> object:
    """What must not change: the bytes of ``a`` (of the memory a producer exposes) and of the
    NumPy buffer under it."""
    if marks is not None:
        return snapshot(marks.backing)
    if isinstance(a, torch.Tensor):  # a view's values, whatever its lazy bits
        return a.detach().resolve_neg().resolve_conj().numpy().tobytes()
    if isinstance(a, np.ndarray):
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        return a.tobytes(), root.tobytes()
    return repr(a)


def f64(a) -> np.ndarray | None:
    """``a``'s values, packed in float64, if it is a NumPy array or torch tensor of a float
    dtype (packed: torch 2.13's CPU backward misreads mixed layouts, see ``fuzz_capi.py``)."""
    if isinstance(a, torch.Tensor) and a.dtype.is_floating_point:
        return np.array(a.detach().resolve_neg().numpy(), np.float64, order="C")
    if isinstance(a, np.ndarray) and (a.dtype.kind == "f" or a.dtype.name == "bfloat16"):
        return np.array(a, np.float64, order="C")  # ml_dtypes' bfloat16 is of kind "V"
    return None


def close(got, want, tol: float, name: str, any_shape: bool = False) -> None:
    """``got`` within ``tol`` of ``want``; ``any_shape``: a per-channel result may come in
    any shape of as many elements (CuPy 13's, that of ``gamma``)."""
    got = f64(got)
    want = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want, np.float64)
    if any_shape and got is not None and got.size == want.size:
        want = want.reshape(got.shape)
    if got is None or got.shape != want.shape:
        raise violation("wrong", f"{name}: got {got!r}, torch has shape {want.shape}")
    if not np.allclose(got, want, atol=tol, rtol=tol, equal_nan=True):
        raise violation("wrong", f"{name}: {got} differs from torch's {want}")


GOOD_REALS = [np.float32(1e-3), np.float64(0.01), 0.0]  # eps 0: the spec's formula has none
TRUTHS, FALSITIES = [True, np.True_, 1, np.array(True)], [False, np.False_, 0, None]
NO_TRUTH = [np.array([True, False])]  # cupyx_compat's bint flags: NumPy's ValueError
CUPY13_DOUBLES = [np.array(1e-3), True]  # what CuPy 13's ``double eps`` took as well
BAD_REALS = [-1.0, float("nan"), float("inf"), "0.1", None, True, [0.1], 10**400]
BAD_MODES = ["training", 7, -1, 1.5, None, True]


class _Stream:
    """A stream object as the array API reads CuPy's and torch's: its address as ``ptr``."""

    ptr = 7


class _BadStream:
    """A stream object whose address (``ptr``) is no cudaStream_t."""

    def __init__(self, ptr: object) -> None:
        self.ptr = ptr


class _BadProtocol:
    """A stream object whose CUDA stream protocol method returns ``result``, no (version,
    address) pair with an address."""

    def __init__(self, result: object) -> None:
        self.result = result

    def __cuda_stream__(self) -> object:
        return self.result


# ``stream=`` of the array API's entry points (AFFINE_OPTIONAL): host arrays run on no
# stream, but one given must be one (an int in [0, 2**64) or a stream object).
GOOD_STREAMS = [None, None, None, 0, 7, (1 << 64) - 1, _Stream()]
BAD_STREAMS = ["a", True, -1, 1 << 64, 1.5, object()]
BAD_STREAMS += [_BadStream(ptr) for ptr in ("a", None, -1, 1 << 64, 1.5, True)]
BAD_STREAMS += [_BadProtocol(result) for result in (5, (), (0, -1), (0, "a"))]
MASKS = [
    (True, True, True), [True, False, True], (np.True_, np.False_, np.True_), (1, 1, 1),
    (True, True), "all", None, (False, False, False),
]  # fmt: skip
FIXED_STATISTICS = ("inference", "cupyx_inference", "fold")  # running_var read as it is
MODES = {"train": "train", "saved": "saved", "eval": "eval", 0: "train", 1: "saved", 2: "eval"}


@dataclass
class Problem:
    """One drawn call: its entry point, shape ``(N, C, ...)``, arguments by name (their
    ``Marks`` where a producer or odd array stands for one), scalars, the ``out=`` form,
    whether it is clean (must be accepted) and the twin call that follows it, if any."""

    entry: str
    shape: tuple[int, ...]
    args: dict
    scalars: dict
    dtype: type
    marks: dict[str, Marks] = field(default_factory=dict)
    out_form: str | None = None
    clean: bool = False
    twin: str | None = None
    reserve_form: str | None = None
    raising: str | None = None  # the one argument of a good problem whose producer raises


def draw_problem(draw) -> Problem:
    entry = draw(st.sampled_from(ENTRY_POINTS))
    ndim = draw(st.integers(2, 4))
    c = draw(st.integers(1, 3))
    rest = draw(st.lists(st.integers(1, 3), min_size=ndim - 1, max_size=ndim - 1))
    n = 0 if draw(st.integers(0, 15)) == 0 else rest[0] + 1  # two or more values per channel
    shape = (n, c, *rest[1:])
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = problem_values(rng, shape)
    batch = draw(st.sampled_from([0, 1, 1, 2, 2, 2, 2]))
    if entry == "batched":  # B problems of their own data, one weight for all
        rows = [problem_values(rng, shape)["input"] for _ in range(batch)]
        values["input"] = np.array(rows).reshape(batch, *shape)
        values["grad_output"] = rng.standard_normal((batch, *shape))
    if values["input"].size and draw(st.integers(0, 9)) == 0:
        values["input"].flat[draw(st.integers(0, values["input"].size - 1))] = np.nan
    if entry in FIXED_STATISTICS and draw(st.integers(0, 3)) == 0:  # var + eps = 0 where
        # eps is 0: an infinite scale (a backward's infinities are not torch's: README)
        values["running_var"][draw(st.integers(0, c - 1))] = 0.0
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    clean = draw(st.integers(0, 3)) == 0
    broken = not clean and draw(st.integers(0, 2)) == 0  # else every array in a good form
    numpy_only = entry.startswith("cupyx") or entry == "fold"  # NumPy or CuPy arrays
    clean_form = "numpy" if numpy_only else draw(st.sampled_from(["numpy", "torch"]))
    args, marks = {}, {}
    for name, value in values.items():
        form = (
            clean_form
            if clean
            else draw(st.sampled_from(FORMS if broken else [*GOOD_FORMS, "producer"]))
        )
        if form == "producer":
            typed = arrange(value, draw(st.sampled_from(PRODUCED_FROM)), dtype)
            args[name], marks[name] = draw(produce(typed))
        else:
            args[name] = arrange(value, form, dtype)
    for name in ("weight", "bias"):  # affine=False, now and then
        if draw(st.sampled_from([False] * 5 + [True])):
            args[name] = None
            marks.pop(name, None)
    raised_by = None  # a good problem but for one producer that raises: it passes through
    readable = [n for n in USES[entry] if args[n] is not None]
    if clean and not numpy_only and readable and draw(st.integers(0, 4)) == 0:
        raised_by = draw(st.sampled_from(readable))
        typed = arrange(values[raised_by], draw(st.sampled_from(PRODUCED_FROM)), dtype)
        args[raised_by], marks[raised_by] = draw(raising(typed))
    if not clean and draw(st.integers(0, 7)) == 0:
        first, second = draw(st.permutations(list(args)))[:2]
        args[second] = args[first]
        if first in marks:
            marks[second] = marks[first]
        else:
            marks.pop(second, None)
    good = clean or draw(st.integers(0, 3)) > 0
    doubles = CUPY13_DOUBLES if entry.startswith("cupyx") else []
    scalars = {
        "eps": draw(
            st.sampled_from([1e-5, 1e-3, 0.1, *GOOD_REALS, *doubles] + ([] if good else BAD_REALS))
        ),
        "momentum": draw(
            st.sampled_from([0.0, 0.1, 1.0, np.float32(0.5)] + ([] if good else BAD_REALS))
        ),
        "mode": draw(
            st.sampled_from(
                ["train", "saved", "eval", 0, 1, 2, np.int64(2)] + ([] if good else BAD_MODES)
            )
        ),
        "output_mask": draw(st.sampled_from(MASKS[:3] if good else MASKS)),
        "conv2d": draw(st.sampled_from(TRUTHS + ([] if good else NO_TRUTH))),  # cupyx's bints
        "debug": draw(st.sampled_from(FALSITIES + ([] if good else NO_TRUTH))),
        "stream": draw(st.sampled_from(GOOD_STREAMS + ([] if good else BAD_STREAMS))),
        "batch": batch,
        "in_place": draw(st.booleans()),  # batched: at any size (else only large problems)
    }
    out_form = None
    if entry in OUTPUTS and draw(st.integers(0, 3)) == 0:
        out_form = draw(st.sampled_from(OUT_FORMS[:2] if clean else OUT_FORMS))
    reserve_form = None
    if entry == "training" and out_form is not None and draw(st.booleans()):
        reserve_form = draw(st.sampled_from(RESERVE_FORMS[:3] if clean else RESERVE_FORMS))
    twin = draw(st.sampled_from(TWINS)) if draw(st.integers(0, 4)) == 0 else None
    twin = None if raised_by else twin  # the raising producer stays the only departure
    problem = Problem(
        entry, shape, args, scalars, dtype, marks, out_form, clean and not raised_by, twin,
        reserve_form, raised_by,
    )  # fmt: skip
    if twin == "overlap":  # first disjoint written operands, then overlapping ones (``twin``)
        _written_pair(problem, overlapping=False)
    return problem


def _written_pair(p: Problem, overlapping: bool) -> None:
    """The running statistics as two views of one buffer: disjoint or overlapping."""
    c = p.shape[1]
    buffer = np.ones(2 * c, p.dtype)
    p.args["running_mean"] = buffer[:c]
    p.args["running_var"] = buffer[min(1, c - 1) : min(1, c - 1) + c] if overlapping else buffer[c:]
    p.marks.pop("running_mean", None)
    p.marks.pop("running_var", None)


def make_outs(p: Problem) -> tuple | None:
    """The ``out=`` tuple of ``p.out_form`` (None: no out=), in the input's kind; filled with
    a sentinel, so that a write shows."""
    if p.out_form is None:
        return None
    x, c = p.args["input"], p.shape[1]
    shapes = {"backward": [p.shape, (c,), (c,)], "training": [p.shape, (c,), (c,)],
              "inference": [p.shape]}[p.entry]  # fmt: skip
    dtype = p.dtype
    on_torch = isinstance(x, torch.Tensor)
    if p.out_form == "wrong_kind":
        on_torch = not on_torch
    if p.out_form == "wrong_dtype":
        dtype = np.int32 if len(shapes) == 1 else np.float16
    if p.out_form == "big_endian":  # refused, never written in the wrong byte order
        dtype, on_torch = np.dtype(dtype).newbyteorder(">"), False
    if p.out_form == "wrong_shape":
        shapes = [(*s[:-1], s[-1] + 1) for s in shapes]

    def new(shape):
        array = np.full(shape, 7.0, dtype)
        return torch.from_numpy(array) if on_torch else array

    outs = [new(s) for s in shapes]
    if p.out_form == "readonly" and not on_torch:
        outs[-1].flags.writeable = False
    if p.out_form == "partial":
        outs[0] = None
    if p.out_form == "alias_input":
        outs[0] = x
    if p.out_form == "alias_each_other" and len(outs) == 3:
        outs[2] = outs[1]
    if p.reserve_form is not None:
        outs.append(_reserve(p.reserve_form, outs[0], on_torch))
    return tuple(outs)


def _reserve(form: str, output: object, on_torch: bool) -> object:
    """A reserve of ``form`` (``RESERVE_FORMS``) for the training forward's ``out[3]``,
    beside its ``output`` (``out[0]``): packed bytes, none, strided, read-only, or the
    output's own bytes; in the input's kind where that kind has the form."""
    size = {"empty": 0}.get(form, 64)
    if on_torch and form in ("good", "empty"):
        return torch.full((size,), 7, dtype=torch.uint8)
    if form == "alias_output" and isinstance(output, np.ndarray):
        root = output  # a strided input given as out[0]: its allocation's bytes
        while isinstance(root.base, np.ndarray):
            root = root.base
        for packed in (output, root, root.T):  # the last axis packed, as a byte view needs
            if packed.ndim and packed.strides[-1] == packed.itemsize:
                return packed.view(np.uint8).reshape(-1)
    reserve = np.full(2 * size if form == "strided" else size, 7, np.uint8)
    if form == "strided":
        return reserve[::2]
    reserve.flags.writeable = form != "readonly"
    return reserve


class Results(list):
    """A training forward's results, then what it wrote in place; ``reserve``, its
    ``.reserve``."""

    def __init__(self, values: list, reserve: object) -> None:
        super().__init__(values)
        self.reserve = reserve


def call(entry: str, args: dict, s: dict, out: tuple | None) -> list:
    """Call ``entry`` on ``args``: its results, then what it wrote in place (a training
    forward's as ``Results``)."""
    x, dy, w, b = (args[n] for n in ("input", "grad_output", "weight", "bias"))
    rm, rv, sm, si = (
        args[n] for n in ("running_mean", "running_var", "saved_mean", "saved_invstd")
    )
    eps, spatial, stream = s["eps"], cupyx.CUDNN_BATCHNORM_SPATIAL, s["stream"]
    conv2d, debug = s["conv2d"], s["debug"]
    outs = {} if out is None else {"out": out}
    if entry == "backward":
        return list(
            cudnn_bn.batch_norm_backward(
                x,
                dy,
                w,
                rm,
                rv,
                eps=eps,
                mode=s["mode"],
                output_mask=s["output_mask"],
                stream=stream,
                **outs,
            )
        )
    if entry == "backward_saved":
        return list(
            cudnn_bn.batch_norm_backward(
                x,
                dy,
                w,
                None,
                None,
                eps=eps,
                mode="saved",
                saved_mean=sm,
                saved_invstd=si,
                stream=stream,
            )
        )
    if entry == "batched":  # folded with copies, or in place, as drawn
        minimum = 0 if s["in_place"] else IN_PLACE_MIN_VALUES
        if minimum != batched_pass.MIN_VALUES:  # a problem is folded or not once
            batched_pass.MIN_VALUES = minimum
            cudnn_bn.descriptor_cache.clear()
        return list(
            cudnn_bn.batch_norm_backward_batched(x, dy, w, None, None, eps=eps, stream=stream)
        )
    if entry == "training":
        outputs = cudnn_bn.batch_norm_forward_training(
            x, w, b, rm, rv, momentum=s["momentum"], eps=eps, stream=stream, **outs
        )
        return Results([*outputs, rm, rv], outputs.reserve)
    if entry == "inference":
        outs = {"out": out[0]} if out is not None else {}  # one array, not a tuple
        return [
            cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=eps, stream=stream, **outs)
        ]
    if entry == "cupyx_training":
        out = cupyx.batch_normalization_forward_training(
            x, w, b, rm, rv, sm, si, eps, _decay(s["momentum"]), conv2d, spatial, debug
        )
        # CuPy 13: y alone when mean/inv_std are given (and filled), else all three
        return [*out, rm, rv] if sm is None and si is None else [out, sm, si, rm, rv]
    if entry == "cupyx_inference":
        return [cupyx.batch_normalization_forward_inference(x, w, b, rm, rv, eps, conv2d, spatial)]
    if entry == "cupyx_backward":
        return list(
            cupyx.batch_normalization_backward(x, w, dy, sm, si, eps, conv2d, spatial, debug)
        )
    return list(cudnn_bn.fold_conv_bn(dy, sm, w, b, rm, rv, eps, transpose=True))


def _decay(momentum):
    """Chainer's decay for a momentum; a bad momentum stays as it is (a bad decay)."""
    is_real = isinstance(momentum, float | np.floating) and not np.isnan(momentum)
    return 1.0 - momentum if is_real else momentum


def _torch_training(v: dict, momentum: float, eps: float) -> list:
    """float64 (output, mean, invstd, running_mean, running_var); aten takes eps 0."""
    names = ("input", "weight", "bias", "running_mean", "running_var")
    t = [None if v[n] is None else torch.from_numpy(v[n].copy()) for n in names]
    kept = [t[3], t[4]]
    if (t[3] is None) != (t[4] is None):  # aten wants both or neither: a stand-in
        c = t[0].shape[1]
        t[3], t[4] = (torch.zeros(c, dtype=torch.float64) if a is None else a for a in kept)
    if not t[0].numel():  # torch's batch_norm: empty output, statistics left, saved unset
        return [torch.empty_like(t[0]), None, None, *kept]
    y, mean, invstd = torch.ops.aten.native_batch_norm(*t, True, momentum, eps)
    return [y, mean, invstd, *(None if a is None else b for a, b in zip(kept, t[3:], strict=True))]


def _inference(v: dict, eps: float) -> list:
    t = [torch.from_numpy(v[n]) for n in ("input", "running_mean", "running_var")]
    w, b = torch.from_numpy(v["weight"]), torch.from_numpy(v["bias"])
    return [torch.nn.functional.batch_norm(*t, w, b, training=False, eps=eps)]


ANY = np.empty(0)  # a result torch leaves uninitialized: any values of the right shape


def _empty_batch(entry: str, v: dict, c: int) -> list:
    """PyTorch's results for N = 0 (``torch.batch_norm``'s empty-input path, which
    ``native_batch_norm`` refuses): an empty output, zero gradients of the parameters, the
    running statistics unchanged; the saved statistics, which torch leaves uninitialized,
    of any value (``ANY``)."""
    x = v["input"] if v["input"] is not None else v["grad_output"]
    if entry in ("backward", "backward_saved", "cupyx_backward", "batched"):
        return [np.empty(x.shape), np.zeros(c), np.zeros(c)]
    if entry in ("inference", "cupyx_inference"):
        return [np.empty(x.shape)]
    return [np.empty(x.shape), ANY, ANY, v["running_mean"], v["running_var"]]


def _batched(v: dict, s: dict, c: int) -> list:
    """One backward per problem (row of the data), stacked; weight (C,) shared."""
    eps, shape = float(s["eps"]), v["input"].shape
    if not shape[0] or not shape[1]:  # B = 0 or N = 0
        return [np.empty(shape), np.zeros((shape[0], c)), np.zeros((shape[0], c))]
    rows = [
        reference(x, dy, v["weight"], eps=eps)
        for x, dy in zip(v["input"], v["grad_output"], strict=True)
    ]
    return [torch.stack(list(g)) for g in zip(*rows, strict=True)]


def expected(entry: str, v: dict, s: dict, c: int) -> list:
    """PyTorch's float64 results for ``entry`` on the values ``v`` the call saw (``c``
    channels; weight 1 and bias 0 where the caller gave None, and no gradient for it)."""
    eps = float(s["eps"])
    absent = [n for n in ("weight", "bias") if v[n] is None]
    v = dict(v, **{n: np.full(c, 1.0 if n == "weight" else 0.0) for n in absent})
    if entry == "batched":
        want = _batched(v, s, c)
    elif entry != "fold" and v["input"].shape[0] == 0:  # N = 0
        want = _empty_batch(entry, v, c)
    elif entry == "backward":
        mode = MODES[s["mode"] if isinstance(s["mode"], str) else int(s["mode"])]
        stats = {} if mode == "train" else {"mean": v["running_mean"], "var": v["running_var"]}
        want = list(
            reference(v["input"], v["grad_output"], v["weight"], mode=mode, eps=eps, **stats)
        )
    elif entry in ("backward_saved", "cupyx_backward"):
        want = list(reference(
            v["input"], v["grad_output"], v["weight"], mode="saved",
            mean=v["saved_mean"], invstd=v["saved_invstd"],
        ))  # fmt: skip
    elif entry == "training":
        return _torch_training(v, float(s["momentum"]), eps)
    elif entry == "cupyx_training":
        return _torch_training(v, 1.0 - float(_decay(s["momentum"])), eps)
    elif entry in ("inference", "cupyx_inference"):
        return _inference(v, eps)
    else:
        scale = v["weight"] / np.sqrt(v["running_var"] + eps)
        shape = (1, -1) + (1,) * (v["grad_output"].ndim - 2)
        return [
            v["grad_output"] * scale.reshape(shape),
            v["bias"] + (v["saved_mean"] - v["running_mean"]) * scale,
        ]
    if entry == "backward":
        want = [g if m else None for g, m in zip(want, s["output_mask"], strict=True)]
    if "weight" in absent and entry in ("backward", "backward_saved", "batched"):
        want[1] = None  # as torch: no gradient for an absent weight
    return want


USES = {  # the arguments each entry point reads
    "backward": ("input", "grad_output", "weight", "running_mean", "running_var"),
    "backward_saved": ("input", "grad_output", "weight", "saved_mean", "saved_invstd"),
    "batched": ("input", "grad_output", "weight"),
    "training": ("input", "weight", "bias", "running_mean", "running_var"),
    "inference": ("input", "weight", "bias", "running_mean", "running_var"),
    "cupyx_training": ("input", "weight", "bias", "running_mean", "running_var"),
    "cupyx_inference": ("input", "weight", "bias", "running_mean", "running_var"),
    "cupyx_backward": ("input", "grad_output", "weight", "saved_mean", "saved_invstd"),
    "fold": ("grad_output", "saved_mean", "weight", "bias", "running_mean", "running_var"),
}
WRITTEN = {  # the arguments an entry point writes in place when it succeeds
    "training": ("running_mean", "running_var"),
    "cupyx_training": ("running_mean", "running_var", "saved_mean", "saved_invstd"),
}


def precision(a, marks: Marks | None = None) -> float:
    """InfiniCore's tolerance for ``a``'s element type (2-byte ones: F16's and BF16's)."""
    dtype = getattr(a, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return TOL.get(dtype, TOL[torch.float64])
    itemsize = marks.itemsize if marks is not None else np.dtype(dtype).itemsize
    return {2: TOL[np.dtype(np.float16)], 4: TOL[np.dtype(np.float32)]}.get(
        itemsize, TOL[np.dtype(np.float64)]
    )


class Tripwire:
    """Counts the package's first step into CUDA (``backends.cuda.cupy_module``)."""

    touched = 0

    @classmethod
    def install(cls) -> None:
        from cudnn_bn.backends import cuda

        original = cuda.cupy_module

        def counted():
            cls.touched += 1
            return original()

        cuda.cupy_module = counted


def attempt(p: Problem, must_refuse: str = "") -> None:
    """One call of ``p`` and every invariant on it (the module's docstring); ``must_refuse``
    says why a twin call must be refused, if it must."""
    entry, args, marks = p.entry, p.args, p.marks
    outs = make_outs(p)
    out_named = {f"out[{i}]": o for i, o in enumerate(outs or ()) if o is not None}
    every = {**args, **out_named}
    COUNTS["examples"] += 1
    COUNTS[f"calls_{entry}"] += 1
    for m in marks.values():
        COUNTS[f"form_{m.lie}"] += 1
    COUNTS["n_zero"] += p.shape[0] == 0
    COUNTS["b_zero"] += entry == "batched" and p.scalars["batch"] == 0
    COUNTS["b_in_place"] += entry == "batched" and p.scalars["in_place"]
    COUNTS["affine_false"] += args["weight"] is None or args["bias"] is None
    COUNTS["clean"] += p.clean
    COUNTS["bad_stream"] += any(p.scalars["stream"] is bad for bad in BAD_STREAMS)
    if p.out_form is not None:
        COUNTS[f"out_{p.out_form}"] += 1
    if p.reserve_form is not None:
        COUNTS[f"reserve_{p.reserve_form}"] += 1
    before = {n: snapshot(a, marks.get(n)) for n, a in every.items()}
    values = {n: f64(a) if n not in marks else _reads(marks[n], entry) for n, a in args.items()}
    touched = Tripwire.touched
    host = [
        n for n in USES[entry]
        if (marks[n].host if n in marks else isinstance(args[n], np.ndarray | torch.Tensor))
    ]  # fmt: skip
    try:
        got = call(entry, args, p.scalars, outs)
    except InfiniError as exc:
        if exc.status == Status.INTERNAL_ERROR:
            raise violation("escapes", f"{entry}: {exc}") from exc
        if p.raising:
            raised = marks[p.raising].raised
            message = f"{entry} refused ({exc}) {p.raising}, whose producer raised {raised!r}"
            raise violation("swallowed", message) from exc
        COUNTS[f"refused_{exc.status.name}"] += 1
        _refused(p, exc, every, before, touched, host)
        return
    except Exception as exc:
        own = [n for n, m in marks.items() if m.raised is not None and exc is m.raised]
        if not own:
            raise violation("escapes", f"{entry} raised {exc!r}") from exc
        if p.raising and exc is not marks[p.raising].raised:
            message = f"{entry} raised {exc!r}, not what {p.raising}'s producer raised"
            raise violation("swallowed", message) from exc
        COUNTS["passed_through"] += 1
        COUNTS["passed_through_alone"] += bool(p.raising)
        _refused(p, exc, every, before, touched, host)
        return
    if p.raising:
        raise violation("wrong", f"{entry} accepted {p.raising}, whose producer raises")
    COUNTS["accepted"] += 1
    if p.reserve_form is not None and got.reserve is not outs[3]:
        raise violation("wrong", f"{entry} returned a .reserve that is not the out[3] given")
    if entry in AFFINE_OPTIONAL and any(p.scalars["stream"] is bad for bad in BAD_STREAMS):
        raise violation("wrong", f"{entry} accepted stream={p.scalars['stream']!r}")
    producers = {id(a): marks[n] for n, a in args.items() if n in marks}
    got = [producers[id(g)].now() if id(g) in producers else g for g in got]  # written ones
    if Tripwire.touched != touched and host:
        raise violation("cuda_calls", f"{entry} touched CUDA with host arrays {host}")
    if must_refuse:
        raise violation("wrong", f"{entry} accepted {must_refuse} on a plan's hit")
    written = set(WRITTEN.get(entry, ())) | set(out_named)
    for name, a in every.items():
        aliases = {n for n, b in every.items() if b is a}
        if not aliases & written and snapshot(a, marks.get(name)) != before[name]:
            raise violation("half_writes", f"{entry} changed {name}, which it only reads")
    for name in written:
        a = every[name]
        if a is None:
            continue
        unwritable = (
            (marks[name].writable is False)
            if name in marks
            else (isinstance(a, np.ndarray) and not a.flags.writeable)
        )
        if unwritable:
            raise violation("wrong", f"{entry} wrote {name}, which cannot be written in place")
    read_or_written = dict.fromkeys(USES[entry] + WRITTEN.get(entry, ()))
    missing = [n for n in read_or_written if values[n] is None and args[n] is not None]
    if missing:
        lies = {n: marks[n].lie for n in missing if n in marks}
        raise violation("wrong", f"{entry} accepted {missing} that are not float arrays {lies}")
    optional = ("weight", "bias") if entry in AFFINE_OPTIONAL else ()
    if any(values[n] is None for n in USES[entry] if n not in optional) and entry not in WRITTEN:
        return  # an optional argument left out that the reference needs; nothing to check
    cupy13 = entry.startswith("cupyx")  # per-channel arrays of any shape (cupyx_compat.py)
    data = ("input", "grad_output")
    flat = {
        n: a.reshape(-1) if cupy13 and a is not None and n not in data else a
        for n, a in values.items()
    }
    want = expected(entry, flat, p.scalars, p.shape[1])
    kind = torch.Tensor if isinstance(args["input"], torch.Tensor) else np.ndarray
    tol = max(
        [
            precision(args[n], marks.get(n))
            for n in USES[entry] + WRITTEN.get(entry, ())
            if values[n] is not None
        ]
        + [precision(o) for o in out_named.values()]
    )
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        given = outs[i] if outs is not None and i < OUTPUTS[entry] else None
        if w is None or (g is None and i >= 3):  # masked off, or no running statistic kept
            if g is not None:
                raise violation("wrong", f"{entry} result {i} was masked off but returned")
            continue
        if given is not None and g is not given:
            raise violation("wrong", f"{entry} result {i} is not the out= array given")
        if (
            given is None
            and i < 3
            and entry not in ("fold", "cupyx_training")
            and not isinstance(g, kind)
        ):
            raise violation("wrong", f"{entry} result {i} is a {type(g).__name__}")
        if w is ANY:  # torch leaves it uninitialized: only its size is checked
            if f64(g) is None or f64(g).size != p.shape[1]:
                raise violation("wrong", f"{entry} result {i}: {g!r}, expected {p.shape[1]} values")
            continue
        close(g, w, tol, f"{entry} result {i}", any_shape=cupy13)
    COUNTS["results_checked"] += 1


def _reads(marks: Marks, entry: str) -> np.ndarray | None:
    """The values a correct reader takes from a drawn form now (a twin call sees what the
    first one wrote), None where it must refuse it; ``fold`` computes by NumPy's own
    arithmetic, which reads what NumPy reads (a big-endian array)."""
    if entry == "fold" and marks.numpy_truth is not None:
        return marks.numpy_truth
    return None if marks.truth is None else marks.now()


def _refused(
    p: Problem, exc: BaseException, every: dict, before: dict, touched: int, host: list
) -> None:
    """A failed call: nothing written, no CUDA for host arrays, and no clean problem refused
    (an empty batch included: every pass takes N = 0 and B = 0)."""
    for name, a in every.items():
        if snapshot(a, p.marks.get(name)) != before[name]:
            raise violation("half_writes", f"{p.entry} failed ({exc}) but changed {name}") from exc
    if Tripwire.touched != touched and host:
        raise violation("cuda_calls", f"{p.entry} touched CUDA with host arrays {host}: {exc}")
    good_out = p.out_form in (None, "good") and p.reserve_form in (None, "good", "empty")
    if p.clean and good_out and not p.twin and not _needs_weight(p):
        raise violation("wrong", f"{p.entry} refused a clean problem: {exc!r}") from exc


def _needs_weight(p: Problem) -> bool:
    """The cuDNN-style entry points (cupyx_compat, fold) may refuse a None gamma/beta."""
    return p.entry not in AFFINE_OPTIONAL and (p.args["weight"] is None or p.args["bias"] is None)


def twin(p: Problem, draw) -> str:
    """``p`` made into a call with the same signature as the one just made, but for one
    property every call must still check: a read-only written operand, a misaligned one,
    overlapping written operands, True for a number (but for ``cupyx_compat``'s eps, 1.0
    there). Returns what must be refused."""
    names = [n for n in USES[p.entry] if type(p.args[n]) is np.ndarray and p.args[n].size]
    if p.twin == "misaligned" and names:
        name = draw(st.sampled_from(names))
        a = p.args[name]
        raw = np.frombuffer(bytearray(a.nbytes + 1), np.uint8)[1:]
        moved = raw.view(a.dtype).reshape(a.shape)
        moved[...] = a
        p.args[name] = moved
        return f"a misaligned {name}" if p.entry != "fold" else ""  # NumPy's arithmetic
    if p.twin == "readonly_written" and p.reserve_form in ("good", "empty"):
        p.reserve_form = "readonly"  # out=, made anew for each call
        return "a read-only out[3]"
    if p.twin == "readonly_written" and p.entry in WRITTEN:
        name = WRITTEN[p.entry][0]
        a = p.args[name]
        if type(a) is np.ndarray:
            frozen = a.copy()
            frozen.flags.writeable = False
            p.args[name] = frozen
            return f"a read-only {name}"
    if p.twin == "overlap" and p.entry in ("training", "cupyx_training"):
        _written_pair(p, overlapping=True)
        return "overlapping running statistics"
    if p.twin == "bad_stream" and p.entry in AFFINE_OPTIONAL:
        p.scalars["stream"] = BAD_STREAMS[0]
        return f"stream={BAD_STREAMS[0]!r}"
    if p.twin == "bool_option":
        key = {"training": "momentum", "backward": "mode"}.get(p.entry, "eps")
        p.scalars[key] = True
        return "" if p.entry.startswith("cupyx") else f"{key}=True"  # CuPy 13's double: 1.0
    return ""


@SETTINGS
@given(st.data())
def fuzz(data) -> None:
    p = draw_problem(data.draw)
    if p.twin == "bool_option":  # the number first: 1.0 / mode 1 plans what True must not hit
        p.scalars[{"training": "momentum", "backward": "mode"}.get(p.entry, "eps")] = (
            1.0 if p.entry != "backward" else 1
        )
    attempt(p)
    if p.twin:
        COUNTS[f"twin_{p.twin}"] += 1
        attempt(p, twin(p, data.draw))


def after_run() -> None:
    """Descriptors live only in the cache: none is left open once it is cleared."""
    cache = cudnn_bn.descriptor_cache
    cache.clear()
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, OperatorDescriptor)]
    if any(d._kernel is not None for d in alive):
        raise violation("leaks", f"{len(alive)} descriptors alive after the cache was cleared")


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # casts of NaN to int in the drawn forms, torch's notes
    Tripwire.install()
    child_main(fuzz, after_run)
