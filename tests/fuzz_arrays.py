"""Fuzz target: every array-API entry point (``test_fuzz.py`` runs it in a child process).

``batch_norm_backward``, ``batch_norm_backward_batched``, ``batch_norm_forward_training``,
``batch_norm_forward_inference``, the four ``cupyx_compat`` functions and ``fold_conv_bn``
get a random problem whose every array argument is drawn in some form: NumPy or torch of a
float dtype (or an integer, bool or complex one), a list, a scalar, None, a string, a
strided, reversed, Fortran-ordered, broadcast, read-only or ``frombuffer`` view, a 0-d
array; sometimes two arguments are one array, the batch is empty, or the input holds NaN;
scalars (eps, momentum, decay, mode, output_mask) come as Python or NumPy values, good or
bad.

Invariants: a call either returns or raises an ``InfiniError`` that is not INTERNAL_ERROR;
a failed call leaves every argument's memory as it was (and a successful one every input
it only reads); a successful one returns arrays of the input's kind equal to PyTorch's
float64 results (NaN where torch has NaN) within ``helpers.TOL``, and updates the running
statistics as torch does; descriptors do not outlive the cache.
"""

import gc
import warnings

import numpy as np
import torch
from fuzzing import COUNTS, SETTINGS, child_main, problem_values, violation
from helpers import TOL, reference
from hypothesis import given
from hypothesis import strategies as st

import cudnn_bn
from cudnn_bn import InfiniError, Status
from cudnn_bn import cupyx_compat as cupyx
from cudnn_bn.ops.descriptor import OperatorDescriptor

FORMS = [
    "numpy", "numpy", "numpy", "numpy", "torch", "torch", "f16", "int", "bool", "complex",
    "list", "scalar", "none", "str", "strided", "reversed", "fortran", "readonly",
    "frombuffer", "zero_d", "broadcast",
]  # fmt: skip
GOOD_FORMS = ["numpy", "torch", "strided", "reversed", "fortran", "readonly", "frombuffer"]
ENTRY_POINTS = [
    "backward", "backward_saved", "batched", "training", "inference",
    "cupyx_training", "cupyx_inference", "cupyx_backward", "fold",
]  # fmt: skip


def arrange(values: np.ndarray, form: str, dtype) -> object:
    """``values`` as an argument of ``form``."""
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


def snapshot(a) -> object:
    """What must not change: the bytes of ``a`` and of the NumPy buffer under it."""
    if isinstance(a, torch.Tensor):
        return a.numpy().tobytes()
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
        return np.array(a.numpy(), np.float64, order="C")
    if isinstance(a, np.ndarray) and a.dtype.kind == "f":
        return np.array(a, np.float64, order="C")
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


GOOD_REALS = [np.float32(1e-3), np.float64(0.01)]
BAD_REALS = [-1.0, float("nan"), float("inf"), "0.1", None, True, [0.1]]
BAD_MODES = ["training", 7, -1, 1.5, None, True]
MASKS = [
    (True, True, True), [True, False, True], (np.True_, np.False_, np.True_), (1, 1, 1),
    (True, True), "all", None, (False, False, False),
]  # fmt: skip
MODES = {"train": "train", "saved": "saved", "eval": "eval", 0: "train", 1: "saved", 2: "eval"}


@st.composite
def problems(draw):
    ndim = draw(st.integers(2, 4))
    c = draw(st.integers(1, 3))
    rest = draw(st.lists(st.integers(1, 3), min_size=ndim - 1, max_size=ndim - 1))
    n = 0 if draw(st.integers(0, 15)) == 0 else rest[0] + 1  # two or more values per channel
    shape = (n, c, *rest[1:])
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = problem_values(rng, shape)
    if values["input"].size and draw(st.integers(0, 9)) == 0:
        values["input"].flat[draw(st.integers(0, values["input"].size - 1))] = np.nan
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    broken = draw(st.integers(0, 2)) == 0  # else every array in a good form
    args = {}
    for name, value in values.items():
        form = draw(st.sampled_from(FORMS if broken else GOOD_FORMS))
        args[name] = arrange(value, form, dtype)
    if draw(st.integers(0, 7)) == 0:
        first, second = draw(st.permutations(list(args)))[:2]
        args[second] = args[first]
    good = draw(st.integers(0, 3)) > 0
    scalars = {
        "eps": draw(st.sampled_from([1e-5, 1e-3, 0.1, *GOOD_REALS] + ([] if good else BAD_REALS))),
        "momentum": draw(
            st.sampled_from([0.0, 0.1, 1.0, np.float32(0.5)] + ([] if good else BAD_REALS))
        ),
        "mode": draw(
            st.sampled_from(
                ["train", "saved", "eval", 0, 1, 2, np.int64(2)] + ([] if good else BAD_MODES)
            )
        ),
        "output_mask": draw(st.sampled_from(MASKS[:3] if good else MASKS)),
        "batch": draw(st.integers(1, 2)),
    }
    return shape, args, scalars


def call(entry: str, args: dict, s: dict) -> list:
    """Call ``entry`` on ``args``: its results, then what it wrote in place."""
    x, dy, w, b = (args[n] for n in ("input", "grad_output", "weight", "bias"))
    rm, rv, sm, si = (
        args[n] for n in ("running_mean", "running_var", "saved_mean", "saved_invstd")
    )
    eps, spatial = s["eps"], cupyx.CUDNN_BATCHNORM_SPATIAL
    if entry == "backward":
        return list(
            cudnn_bn.batch_norm_backward(
                x, dy, w, rm, rv, eps=eps, mode=s["mode"], output_mask=s["output_mask"]
            )
        )
    if entry == "backward_saved":
        return list(
            cudnn_bn.batch_norm_backward(
                x, dy, w, None, None, eps=eps, mode="saved", saved_mean=sm, saved_invstd=si
            )
        )
    if entry == "batched":
        return list(
            cudnn_bn.batch_norm_backward_batched(
                _stack(x, s["batch"]), _stack(dy, s["batch"]), w, None, None, eps=eps
            )
        )
    if entry == "training":
        outputs = cudnn_bn.batch_norm_forward_training(
            x, w, b, rm, rv, momentum=s["momentum"], eps=eps
        )
        return [*outputs, rm, rv]
    if entry == "inference":
        return [cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, eps=eps)]
    if entry == "cupyx_training":
        out = cupyx.batch_normalization_forward_training(
            x, w, b, rm, rv, sm, si, eps, _decay(s["momentum"]), True, spatial, False
        )
        # CuPy 13: y alone when mean/inv_std are given (and filled), else all three
        return [*out, rm, rv] if sm is None and si is None else [out, sm, si, rm, rv]
    if entry == "cupyx_inference":
        return [cupyx.batch_normalization_forward_inference(x, w, b, rm, rv, eps, True, spatial)]
    if entry == "cupyx_backward":
        return list(cupyx.batch_normalization_backward(x, w, dy, sm, si, eps, True, spatial, False))
    return list(cudnn_bn.fold_conv_bn(dy, sm, w, b, rm, rv, eps, transpose=True))


def _stack(a, batch: int):
    """``batch`` copies of ``a`` along a new first axis, in ``a``'s kind (else ``a``)."""
    if isinstance(a, torch.Tensor):
        return torch.stack([a] * batch)
    return np.stack([a] * batch) if isinstance(a, np.ndarray) and a.ndim else a


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


def expected(entry: str, v: dict, s: dict) -> list:
    """PyTorch's float64 results for ``entry`` on the values ``v`` the call saw."""
    eps = float(s["eps"])
    if entry == "backward":
        mode = MODES[s["mode"] if isinstance(s["mode"], str) else int(s["mode"])]
        stats = {} if mode == "train" else {"mean": v["running_mean"], "var": v["running_var"]}
        want = reference(v["input"], v["grad_output"], v["weight"], mode=mode, eps=eps, **stats)
        return [g if m else None for g, m in zip(want, s["output_mask"], strict=True)]
    if entry in ("backward_saved", "cupyx_backward"):
        return list(reference(
            v["input"], v["grad_output"], v["weight"], mode="saved",
            mean=v["saved_mean"], invstd=v["saved_invstd"],
        ))  # fmt: skip
    if entry == "batched":  # weight (C,) is shared, (B, C) one row per problem
        w = v["weight"]
        rows = [reference(v["input"], v["grad_output"], w[b] if w.ndim == 2 else w, eps=eps)
                for b in range(s["batch"])]  # fmt: skip
        return [torch.stack(list(g)) for g in zip(*rows, strict=True)]
    if entry == "training":
        return _torch_training(v, float(s["momentum"]), eps)
    if entry == "cupyx_training":
        return _torch_training(v, 1.0 - float(_decay(s["momentum"])), eps)
    if entry in ("inference", "cupyx_inference"):
        return _inference(v, eps)
    scale = v["weight"] / np.sqrt(v["running_var"] + eps)
    shape = (1, -1) + (1,) * (v["grad_output"].ndim - 2)
    weight = v["grad_output"] * scale.reshape(shape)
    return [weight, v["bias"] + (v["saved_mean"] - v["running_mean"]) * scale]


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


def tolerance(args: dict, names) -> float:
    """InfiniCore's tolerance for the least precise float array among ``names``."""
    dtypes = {
        np.dtype(str(args[n].dtype).removeprefix("torch."))
        for n in names
        if f64(args[n]) is not None
    }
    return max((TOL[d] for d in dtypes if d in TOL), default=TOL[np.dtype(np.float64)])


@SETTINGS
@given(st.sampled_from(ENTRY_POINTS), problems())
def fuzz(entry, problem) -> None:
    _, args, scalars = problem
    COUNTS["examples"] += 1
    COUNTS[f"calls_{entry}"] += 1
    before = {n: snapshot(a) for n, a in args.items()}
    values = {n: f64(a) for n, a in args.items()}
    try:
        got = call(entry, args, scalars)
    except InfiniError as exc:
        if exc.status == Status.INTERNAL_ERROR:
            raise violation("escapes", f"{entry}: {exc}") from exc
        COUNTS[f"refused_{exc.status.name}"] += 1
        for name, a in args.items():
            if snapshot(a) != before[name]:
                raise violation(
                    "half_writes", f"{entry} failed ({exc}) but changed {name}"
                ) from exc
        return
    except Exception as exc:
        raise violation("escapes", f"{entry} raised {exc!r}") from exc
    COUNTS["accepted"] += 1
    written = WRITTEN.get(entry, ())
    for name, a in args.items():
        aliases = {n for n, b in args.items() if b is a}
        if not aliases & set(written) and snapshot(a) != before[name]:
            raise violation("half_writes", f"{entry} changed {name}, which it only reads")
    missing = [n for n in USES[entry] if values[n] is None and args[n] is not None]
    if missing:
        raise violation("wrong", f"{entry} accepted {missing} that are not float arrays")
    if any(values[n] is None for n in USES[entry]) and entry not in WRITTEN:
        return  # an optional argument left out that the reference needs; nothing to check
    cupy13 = entry.startswith("cupyx")  # per-channel arrays of any shape (cupyx_compat.py)
    data = ("input", "grad_output")
    flat = {
        n: a.reshape(-1) if cupy13 and a is not None and n not in data else a
        for n, a in values.items()
    }
    want = expected(entry, flat, scalars)
    kind = torch.Tensor if isinstance(args["input"], torch.Tensor) else np.ndarray
    tol = tolerance(args, USES[entry] + WRITTEN.get(entry, ()))
    unset = (1, 2) if "training" in entry and not flat["input"].size else ()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i in unset:  # an empty batch's saved statistics: torch leaves them uninitialized
            continue
        if w is None or (g is None and i >= 3):  # masked off, or no running statistic kept
            if g is not None:
                raise violation("wrong", f"{entry} result {i} was masked off but returned")
            continue
        if i < 3 and entry not in ("fold", "cupyx_training") and not isinstance(g, kind):
            raise violation("wrong", f"{entry} result {i} is a {type(g).__name__}")
        close(g, w, tol, f"{entry} result {i}", any_shape=cupy13)
    COUNTS["results_checked"] += 1


def after_run() -> None:
    """Descriptors live only in the cache: none is left once it is cleared."""
    cache = cudnn_bn.descriptor_cache
    cache.clear()
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, OperatorDescriptor)]
    if cache._leases or cache._evicted or any(d._kernel is not None for d in alive):
        raise violation("leaks", f"{len(alive)} descriptors alive after the cache was cleared")


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # casts of NaN to int in the drawn forms, torch's notes
    child_main(fuzz, after_run)
