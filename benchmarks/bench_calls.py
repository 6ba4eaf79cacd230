"""Per-call cost of tiny batch norms: the array API, a cached descriptor's ``compute`` and the
C API side by side with torch's CPU call, in one process (issue 17's targets).

    PYTHONPATH=. python benchmarks/bench_calls.py [--out DIR] [--quick] [--rounds N]
        [--sample-ms MS] [--threads 1,2] [--batched-only]

Problems: F32 (8, 4), (2, 16, 16) and (4, 64, 7, 7); passes: training forward, inference
forward, backward in train mode (statistics recomputed) and in saved mode (the forward's
saved mean and invstd). Sections, each at every thread count of ``--threads`` (torch's
``set_num_threads`` and the CPU engine's ``cpu_pool.set_thread_count``):

- CPU: ``cudnn_bn.batch_norm_*`` on NumPy arrays (``array``: outputs allocated per call;
  ``array_out``: every output given as ``out=``, the training forward's reserve included, as
  a loop reusing its buffers gives them), the cached descriptor's ``compute`` and
  ``cudnn_bn.capi`` (descriptors made once, ``infiniopBatchNorm*`` called with ints, as
  ``examples/infiniop_batch_norm_backward.py`` does) against torch on the same memory:
  ``F.batch_norm`` for the forwards, and for both backwards
  ``torch.ops.aten.native_batch_norm_backward`` with the forward's saved statistics (what
  autograd calls for ``F.batch_norm``, without the autograd engine's own cost).
- NVIDIA path on the host stand-ins (``stand_ins.py``: the stub libcudnn, CuPy stand-in
  arrays; skipped without gcc): the array API (both ways) and ``compute``, torch's CPU call
  as the dispatch reference. (8, 4) runs as (8, 4, 1): 2-D input goes to the CuPy kernels, which
  the stand-ins cannot run, not to cuDNN. The CuPy stand-in's own Python (``own_share``) is
  reported beside each device-array figure, and each ratio of one again without it.
- Batched backward (train mode): ``batch_norm_backward_batched`` on ``B = 64`` problems
  ``(64, *shape)`` against one ``batch_norm_backward`` on the folded problem of the same size
  (``(N, 64 C, ...)``), on the CPU and on the stand-ins.

Timing: the ways of a problem run interleaved, round by round (``--rounds``), each sample
being as many back-to-back calls as fill ``--sample-ms`` after 5 ms idle (so that the
previous way's OpenMP threads stop spinning, as in ``bench_cpu.py``); a figure is the
median time per call with its min, max and quartiles. Each way's first call is checked
against torch in float64 (max |difference|; F32 tolerance atol = rtol = 2e-5); the
stand-ins compute nothing.
/proc/loadavg is recorded before and after each section. Writes ``<out>/calls-<date>.md``
and ``.json``; ``--quick`` is a dry run on one problem (a test runs it) that refuses to write
into ``benchmarks/results``. The exit status is 1 when a result is outside tolerance.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from ctypes import byref, c_size_t, c_ssize_t, c_void_p
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from interleaving import alternating

import cudnn_bn
from cudnn_bn import (
    BatchNormBackwardDescriptor,
    BatchNormForwardInferenceDescriptor,
    BatchNormForwardTrainingDescriptor,
    DataType,
    Device,
    Handle,
    Mode,
    Status,
    TensorDesc,
    capi,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
SHAPES = ((8, 4), (2, 16, 16), (4, 64, 7, 7))
QUICK_SHAPES = ((8, 4),)
PASSES = ("forward_training", "forward_inference", "backward_train", "backward_saved")
BATCH = 64
EPS, MOMENTUM = 1e-5, 0.1
TOL = 2e-5  # F32: atol = rtol
SETTLE_S = 0.005  # idle before each sample (untimed): spinning OpenMP threads go idle
# Issue 17's targets: (numerator, denominator) -> the most their median ratio may be.
CPU_TARGETS = {("array", "torch"): 1.5}
CPU_RATIOS = (
    ("array", "torch"),
    ("array_out", "torch"),
    ("compute", "torch"),
    ("capi", "torch"),
    ("array", "compute"),
)
NVIDIA_TARGETS = {("array", "compute"): 1.5, ("array", "torch"): 2.0}
NVIDIA_RATIOS = (*NVIDIA_TARGETS, ("array_out", "compute"))
BATCHED_TARGETS = {("batched", "unbatched"): 2.0}

Calls = dict[str, Callable[[], Any]]  # pass name -> one call, returning its results


# --- operands ------------------------------------------------------------------------------

# Written by the operators (compute and the C API write into these; the array API allocates).
OUTPUTS = ("y", "saved_mean", "saved_invstd", "dx", "dw", "db", "train_rm", "train_rv")


def host_operands(shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    """F32 x, dy, w, b, rm, rv, the statistics torch's training forward saves (mean,
    invstd), and the outputs: ``train_rm``/``train_rv`` start as copies of rm/rv."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    ops = {
        "x": rng.standard_normal(shape) * 2 + 0.5,
        "dy": rng.standard_normal(shape),
        "w": rng.uniform(0.5, 1.5, c),
        "b": rng.standard_normal(c) * 0.5,
        "rm": rng.standard_normal(c) * 0.3,
        "rv": rng.uniform(0.5, 2.0, c),
    }
    ops = {name: a.astype(np.float32) for name, a in ops.items()}
    t = {name: torch.from_numpy(a) for name, a in ops.items()}
    _, mean, invstd = torch.ops.aten.native_batch_norm(
        t["x"], t["w"], t["b"], None, None, True, MOMENTUM, EPS
    )
    ops.update(mean=mean.numpy(), invstd=invstd.numpy())
    ops.update({name: np.empty_like(ops["x"]) for name in ("y", "dx")})
    ops.update({name: np.empty_like(ops["w"]) for name in ("saved_mean", "saved_invstd")})
    ops.update(dw=np.empty_like(ops["w"]), db=np.empty_like(ops["w"]))
    ops.update(train_rm=ops["rm"].copy(), train_rv=ops["rv"].copy())
    return ops


def folded(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The one problem as large as ``BATCH`` problems of ``shape``: the batch in the channels."""
    return (shape[0], BATCH * shape[1], *shape[2:])


def describe(array: Any) -> tuple[TensorDesc, int]:
    """An F32 NumPy array's or CuPy stand-in's descriptor and address."""
    strides = tuple(s // array.itemsize for s in array.strides)
    ptr = array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr
    return TensorDesc(DataType.F32, tuple(array.shape), strides), ptr


# --- the ways of calling -------------------------------------------------------------------


def array_calls(ops: dict[str, Any]) -> Calls:
    """The array API on ``ops`` (NumPy arrays or CuPy stand-ins): outputs allocated per call."""
    x, dy, w, b = ops["x"], ops["dy"], ops["w"], ops["b"]
    saved = {"mode": "saved", "saved_mean": ops["mean"], "saved_invstd": ops["invstd"]}
    return {
        "forward_training": lambda: cudnn_bn.batch_norm_forward_training(
            x, w, b, ops["train_rm"], ops["train_rv"], momentum=MOMENTUM, eps=EPS
        ),
        "forward_inference": lambda: (
            cudnn_bn.batch_norm_forward_inference(x, w, b, ops["rm"], ops["rv"], eps=EPS),
        ),
        "backward_train": lambda: cudnn_bn.batch_norm_backward(x, dy, w, None, None, eps=EPS),
        "backward_saved": lambda: cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, eps=EPS, **saved
        ),
    }


def array_out_calls(ops: dict[str, Any]) -> Calls:
    """The array API given every output (``out=``), as a loop reusing its buffers does: the
    training forward's reserve is its first call's ``.reserve``. Nothing is allocated per
    call, as for ``compute``: what is left is the array layer's own cost."""
    x, dy, w, b = ops["x"], ops["dy"], ops["w"], ops["b"]
    running = (ops["train_rm"], ops["train_rv"])
    reserve = cudnn_bn.batch_norm_forward_training(x, w, b, *running, eps=EPS).reserve
    training = (ops["y"], ops["saved_mean"], ops["saved_invstd"], reserve)
    grads = (ops["dx"], ops["dw"], ops["db"])
    saved = {"mode": "saved", "saved_mean": ops["mean"], "saved_invstd": ops["invstd"]}
    return {
        "forward_training": lambda: cudnn_bn.batch_norm_forward_training(
            x, w, b, *running, momentum=MOMENTUM, eps=EPS, out=training
        ),
        "forward_inference": lambda: (
            cudnn_bn.batch_norm_forward_inference(
                x, w, b, ops["rm"], ops["rv"], eps=EPS, out=ops["y"]
            ),
        ),
        "backward_train": lambda: cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, eps=EPS, out=grads
        ),
        "backward_saved": lambda: cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, eps=EPS, out=grads, **saved
        ),
    }


def compute_calls(ops: dict[str, Any], device: Device, scratch: Callable[[int], int]) -> Calls:
    """Cached descriptors' ``compute`` on the addresses of ``ops``, taken once, as a caller
    holding its buffers would; ``scratch(nbytes)`` gives a workspace or reserve address."""
    d, p = {}, {}
    for name, array in ops.items():
        d[name], p[name] = describe(array)
    handle = Handle(device, 0)
    training = BatchNormForwardTrainingDescriptor(
        handle, *(d[n] for n in TRAINING), eps=EPS, momentum=MOMENTUM
    )
    inference = BatchNormForwardInferenceDescriptor(handle, *(d[n] for n in INFERENCE), eps=EPS)
    train = BatchNormBackwardDescriptor(
        handle, *(d[n] for n in BACKWARD[:6]), None, None, eps=EPS, mode=Mode.TRAIN
    )
    saved = BatchNormBackwardDescriptor(
        handle, *(d[n] for n in BACKWARD_SAVED), eps=EPS, mode=Mode.SAVED_INVSTD
    )

    def buffers(*sizes: int) -> tuple[int, ...]:
        return tuple(v for size in sizes for v in (scratch(size) if size else 0, size))

    t = (*buffers(training.workspace_size, training.reserve_size), *(p[n] for n in TRAINING))
    i = (*buffers(inference.workspace_size), *(p[n] for n in INFERENCE))
    bt = (*buffers(train.workspace_size), *(p[n] for n in BACKWARD[:6]), 0, 0)
    bs = (*buffers(saved.workspace_size), *(p[n] for n in BACKWARD_SAVED))
    results = {name: ops[name] for name in ("y", "saved_mean", "saved_invstd", "dx", "dw", "db")}
    r = {k: tuple(results[n] for n in names) for k, names in RESULTS.items()}
    return {
        "forward_training": lambda: training.compute(*t) or r["forward_training"],
        "forward_inference": lambda: inference.compute(*i) or r["forward_inference"],
        "backward_train": lambda: train.compute(*bt) or r["backward"],
        "backward_saved": lambda: saved.compute(*bs) or r["backward"],
    }


# The operators' argument orders over the names of ``host_operands``.
TRAINING = ("y", "saved_mean", "saved_invstd", "x", "w", "b", "train_rm", "train_rv")
INFERENCE = ("y", "x", "w", "b", "rm", "rv")
BACKWARD = ("dx", "dw", "db", "x", "dy", "w", "rm", "rv")
BACKWARD_SAVED = (*BACKWARD[:6], "mean", "invstd")
RESULTS = {
    "forward_training": ("y", "saved_mean", "saved_invstd"),
    "forward_inference": ("y",),
    "backward": ("dx", "dw", "db"),
}


def _ok(status: int, function: str) -> None:
    if status != Status.SUCCESS:
        raise RuntimeError(f"{function} returned {Status(status).name}: {capi.last_error()}")


def capi_calls(ops: dict[str, np.ndarray]) -> Calls:
    """``cudnn_bn.capi`` on the CPU: descriptors made once, then each call the operator's
    function with integer addresses, NULL workspace and stream (the CPU needs none)."""
    _ok(capi.infinirtSetDevice(Device.CPU, 0), "infinirtSetDevice")
    handle = c_void_p()
    _ok(capi.infiniopCreateHandle(byref(handle)), "infiniopCreateHandle")

    def operator(kind: str, names: tuple[str, ...], *attributes: float) -> c_void_p:
        descs = []
        for name in names:
            desc, a = c_void_p(), ops[name]
            strides = (s // a.itemsize for s in a.strides)
            n, create = a.ndim, capi.infiniopCreateTensorDescriptor
            shape, c_strides = (c_size_t * n)(*a.shape), (c_ssize_t * n)(*strides)
            _ok(create(byref(desc), n, shape, c_strides, DataType.F32), "CreateTensorDescriptor")
            descs.append(desc)
        op = c_void_p()
        create_op = getattr(capi, f"infiniopCreate{kind}Descriptor")
        _ok(create_op(handle, byref(op), *descs), f"infiniopCreate{kind}Descriptor")
        for desc in descs:
            _ok(capi.infiniopDestroyTensorDescriptor(desc), "infiniopDestroyTensorDescriptor")
        _ok(getattr(capi, f"infiniopSet{kind}Attributes")(op, *attributes), f"Set{kind}Attributes")
        return op

    def call(kind: str, op: c_void_p, names: tuple[str, ...], buffers: int, results) -> Callable:
        function, args = getattr(capi, f"infiniop{kind}"), (None, 0) * buffers
        pointers = [ops[name].ctypes.data for name in names]

        def run() -> tuple:
            _ok(function(op, *args, *pointers, None), f"infiniop{kind}")
            return results

        return run

    r = {k: tuple(ops[n] for n in names) for k, names in RESULTS.items()}
    training = operator("BatchNormForwardTraining", TRAINING, EPS, MOMENTUM)
    inference = operator("BatchNormForwardInference", INFERENCE, EPS)
    train = operator("BatchNormBackward", BACKWARD, EPS, Mode.TRAIN)
    saved = operator("BatchNormBackward", BACKWARD_SAVED, EPS, Mode.SAVED_INVSTD)
    kind = "BatchNormBackward"
    return {
        "forward_training": call(
            "BatchNormForwardTraining", training, TRAINING, 2, r["forward_training"]
        ),
        "forward_inference": call(
            "BatchNormForwardInference", inference, INFERENCE, 1, r["forward_inference"]
        ),
        "backward_train": call(kind, train, BACKWARD, 1, r["backward"]),
        "backward_saved": call(kind, saved, BACKWARD_SAVED, 1, r["backward"]),
    }


def torch_calls(ops: dict[str, np.ndarray]) -> Calls:
    """What a torch user calls, on the same memory (see the module's docstring)."""
    t = {name: torch.from_numpy(a) for name, a in ops.items()}
    x, dy, w, b, mean, invstd = (t[n] for n in ("x", "dy", "w", "b", "mean", "invstd"))
    backward = torch.ops.aten.native_batch_norm_backward
    mask = [True, True, True]
    return {
        "forward_training": lambda: (
            F.batch_norm(x, t["train_rm"], t["train_rv"], w, b, True, MOMENTUM, EPS),
        ),
        "forward_inference": lambda: (F.batch_norm(x, t["rm"], t["rv"], w, b, False, 0.0, EPS),),
        "backward_train": lambda: backward(dy, x, w, None, None, mean, invstd, True, EPS, mask),
        "backward_saved": lambda: backward(dy, x, w, None, None, mean, invstd, True, EPS, mask),
    }


def references(ops: dict[str, np.ndarray]) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every pass in float64 by torch, on the F32 operands."""
    d = {name: torch.from_numpy(a).to(torch.float64) for name, a in ops.items()}
    x, w, b = d["x"], d["w"], d["b"]
    return {
        "forward_training": torch.ops.aten.native_batch_norm(
            x, w, b, None, None, True, MOMENTUM, EPS
        ),
        "forward_inference": (F.batch_norm(x, d["rm"], d["rv"], w, b, False, 0.0, EPS),),
        "backward_train": backward_reference(x, d["dy"], w),
        "backward_saved": backward_reference(x, d["dy"], w, d["mean"], d["invstd"]),
    }


def backward_reference(x, dy, w, mean=None, invstd=None) -> tuple[torch.Tensor, ...]:
    """torch's backward on float64 tensors, with the batch statistics of ``x`` unless the
    saved ``mean``/``invstd`` are given."""
    if mean is None:
        _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, None, None, None, True, 0, EPS)
    return torch.ops.aten.native_batch_norm_backward(
        dy, x, w, None, None, mean, invstd, True, EPS, [True, True, True]
    )


def max_abs_diff(got: tuple, want: tuple) -> tuple[float, bool]:
    """The largest |got - want| over the results ``got`` has, and whether all are within
    atol = rtol = ``TOL``."""
    worst, ok = 0.0, True
    for g, r in zip(got, want, strict=False):
        g = torch.as_tensor(np.asarray(g), dtype=torch.float64).reshape(r.shape)
        diff = (g - r).abs()
        worst = max(worst, float(diff.max()))
        ok = ok and bool((diff <= TOL + TOL * r.abs()).all())
    return worst, ok


# --- timing --------------------------------------------------------------------------------


@dataclass
class Figure:
    """One way's times per call (seconds) and the accuracy of its first call."""

    calls_per_sample: int
    times: list[float] = field(default_factory=list)
    max_abs_diff: float | None = None
    ok: bool = True

    def summary(self) -> dict:
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        us = lambda s: round(s * 1e6, 3)  # noqa: E731
        return {
            "median_us": us(statistics.median(self.times)),
            "min_us": us(min(self.times)),
            "max_us": us(max(self.times)),
            "q1_us": us(q1),
            "q3_us": us(q3),
            "calls_per_sample": self.calls_per_sample,
            "samples": len(self.times),
            "max_abs_diff": self.max_abs_diff,
            "within_tolerance": self.ok,
        }


def calls_filling(call: Callable[[], Any], seconds: float) -> int:
    """How many back-to-back calls take about ``seconds`` (after three warm-up calls)."""
    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(5):
        call()
    each = (time.perf_counter() - start) / 5
    return max(1, min(100_000, round(seconds / each)))


@dataclass(frozen=True)
class Timing:
    """``rounds`` samples per way of about ``sample_s`` seconds each; ``between`` runs after
    each sample, untimed."""

    rounds: int
    sample_s: float
    between: Callable[[], None] = lambda: None


def interleaved(ways: dict[str, Callable[[], Any]], timing: Timing) -> dict:
    """Each way timed in turn, ``timing.rounds`` times, the order reversed every other
    round (``interleaving.alternating``): ``{way: Figure}``."""
    figures = {name: Figure(calls_filling(call, timing.sample_s)) for name, call in ways.items()}
    for round_ in range(timing.rounds):
        for name, call in alternating(ways, round_):
            n = figures[name].calls_per_sample
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            for _ in range(n):
                call()
            figures[name].times.append((time.perf_counter() - start) / n)
            timing.between()
    return figures


def row(label: dict, ways: dict, timing: Timing, want: dict, ratios, targets) -> dict:
    """Time ``ways``, checking the first call of each way ``want`` has a reference for, and
    the ratios of their medians, each with its target where it has one."""
    checked = {name: max_abs_diff(ways[name](), ref) for name, ref in want.items()}
    figures = interleaved(ways, timing)
    for name, (diff, ok) in checked.items():
        figures[name].max_abs_diff, figures[name].ok = diff, ok
    result = {**label, "ways": {name: f.summary() for name, f in figures.items()}, "ratios": []}
    for num, den in ratios:
        value = result["ways"][num]["median_us"] / result["ways"][den]["median_us"]
        target = targets.get((num, den))
        met = None if target is None else value <= target
        result["ratios"].append(
            {"name": f"{num} / {den}", "value": round(value, 3), "target": target, "met": met}
        )
    print(_line(result), flush=True)
    return result


def _line(result: dict) -> str:
    times = " ".join(f"{n} {w['median_us']:.1f}" for n, w in result["ways"].items())
    ratios = " ".join(f"{r['name']} {r['value']:.2f}" for r in result["ratios"])
    return f"  {result['shape']!s:16} {result['pass']:18} us: {times} | {ratios}"


# --- sections ------------------------------------------------------------------------------


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


@contextmanager
def section(title: str, threads: int, sections: list) -> Iterator[list]:
    """A table: its rows are appended to the yielded list; loadavg recorded around it."""
    rows: list[dict] = []
    before = loadavg()
    print(f"{title} ({threads} thread{'s' * (threads > 1)}; loadavg {before})", flush=True)
    yield rows
    sections.append(
        {"title": title, "threads": threads, "loadavg": [before, loadavg()], "rows": rows}
    )


def cpu_rows(shapes, timing: Timing) -> list[dict]:
    """Every pass of each shape on the CPU: the array API, compute, the C API and torch."""
    rows = []
    for shape in shapes:
        ops = host_operands(shape)
        want = references(ops)
        ways = {
            "array": array_calls(ops),
            "array_out": array_out_calls(ops),
            "compute": compute_calls(ops, Device.CPU, _host_scratch()),
            "capi": capi_calls(ops),
            "torch": torch_calls(ops),
        }
        for name in PASSES:
            calls = {way: by_pass[name] for way, by_pass in ways.items()}
            label = {"shape": list(shape), "pass": name}
            checked = dict.fromkeys(calls, want[name])
            rows.append(row(label, calls, timing, checked, CPU_RATIOS, CPU_TARGETS))
    return rows


def _host_scratch() -> Callable[[int], int]:
    """Workspace and reserve buffers kept alive as long as the returned function."""
    kept: list[np.ndarray] = []

    def scratch(nbytes: int) -> int:
        kept.append(np.empty(nbytes, np.uint8))
        return kept[-1].ctypes.data

    return scratch


def on_cudnn(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` as cuDNN takes it: 2-D (N, C) as (N, C, 1), as PyTorch and this package
    send 2-D input to their own kernels, not to cuDNN (which the stand-ins replace)."""
    return (*shape, 1) if len(shape) == 2 else shape


def with_stand_ins_share(fake: Any, result: dict, ways: dict) -> dict:
    """``result`` with the CuPy stand-in's own time per call of each device-array way (its
    median share of 5 runs of a sample's calls, times the median), and each ratio of such a
    way again with that time taken out (an estimate)."""
    from stand_ins import own_share

    shares = {}
    for name in ("array", "array_out", "batched", "unbatched"):
        if name in ways:
            figure = result["ways"][name]
            runs = [own_share(fake, ways[name], figure["calls_per_sample"]) for _ in range(5)]
            shares[name] = round(statistics.median(runs) * figure["median_us"], 3)
    result["stand_ins_us"] = shares
    for ratio in list(result["ratios"]):
        num, den = ratio["name"].split(" / ")
        if num not in shares:
            continue
        net = [result["ways"][n]["median_us"] - shares.get(n, 0.0) for n in (num, den)]
        value = round(net[0] / net[1], 3)
        name = f"{num} / {den} less stand-in"
        result["ratios"].append({"name": name, "value": value, "target": None, "met": None})
    return result


def nvidia_rows(fake: Any, shapes, timing: Timing) -> list[dict]:
    """Every pass of each shape on the stand-ins: the array API, compute, and torch's CPU call."""
    from stand_ins import cudnn_stub

    rows = []
    for shape in map(on_cudnn, shapes):
        host = host_operands(shape)
        ops = {name: fake.array(a.shape) for name, a in host.items()}
        ways = {
            "array": array_calls(ops),
            "array_out": array_out_calls(ops),
            "compute": compute_calls(ops, Device.NVIDIA, lambda _: cudnn_stub.WORKSPACE),
            "torch": torch_calls(host),
        }
        for name in PASSES:
            calls = {way: by_pass[name] for way, by_pass in ways.items()}
            label = {"shape": list(shape), "pass": name}
            result = row(label, calls, timing, {}, NVIDIA_RATIOS, NVIDIA_TARGETS)
            rows.append(with_stand_ins_share(fake, result, calls))
    return rows


def batched_rows(fake: Any, shapes, timing: Timing) -> list[dict]:
    """``batch_norm_backward_batched`` on ``BATCH`` problems of each shape against one call
    on the folded problem: NumPy arrays (checked) where ``fake`` is None, else its arrays."""
    make = fake.array if fake is not None else lambda shape: np.empty(shape, np.float32)
    rows = []
    for shape in shapes:
        c = shape[1]
        x, dy, w = make((BATCH, *shape)), make((BATCH, *shape)), make((c,))
        fx, fdy, fw = make(folded(shape)), make(folded(shape)), make((BATCH * c,))
        want = None
        if isinstance(x, np.ndarray):
            rng = np.random.default_rng(1)
            x[...], dy[...] = rng.standard_normal(x.shape) * 2 + 0.5, rng.standard_normal(x.shape)
            w[...] = rng.uniform(0.5, 1.5, c)
            fx[...], fdy[...], fw[...] = _fold(x), _fold(dy), np.tile(w, BATCH)
            f64 = (torch.from_numpy(a).to(torch.float64) for a in (fx, fdy, fw))
            dx, dw, db = backward_reference(*f64)
            dx = dx.reshape(shape[0], BATCH, *shape[1:]).movedim(1, 0)  # (B, N, C, ...)
            want = (dx, dw.reshape(BATCH, c), db.reshape(BATCH, c))
        ways = {
            "batched": lambda x=x, dy=dy, w=w: cudnn_bn.batch_norm_backward_batched(
                x, dy, w, None, None, eps=EPS
            ),
            "unbatched": lambda x=fx, dy=fdy, w=fw: cudnn_bn.batch_norm_backward(
                x, dy, w, None, None, eps=EPS
            ),
        }
        label = {"shape": [BATCH, *shape], "pass": "backward_train"}
        checked = {"batched": want} if want is not None else {}
        ratios = tuple(BATCHED_TARGETS)
        result = row(label, ways, timing, checked, ratios, BATCHED_TARGETS)
        if fake is not None:
            result = with_stand_ins_share(fake, result, ways)
        rows.append(result)
    return rows


def _fold(a: np.ndarray) -> np.ndarray:
    """(B, N, C, ...) -> (N, B*C, ...): problem b's channels are the b-th block of C."""
    return np.moveaxis(a, 0, 1).reshape(folded(a.shape[1:]))


# --- report --------------------------------------------------------------------------------


def set_threads(threads: int) -> int:
    """torch's and the CPU engine's thread count (``cpu_pool``); returns the engine's."""
    from cudnn_bn.backends import cpu_pool

    torch.set_num_threads(threads)
    cpu_pool.set_thread_count(threads)
    return cpu_pool.thread_count()


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Per-call cost of tiny batch norms ({meta['date']})", ""]
    if meta["quick"]:
        lines += ["**QUICK DRY RUN: not measurements.**", ""]
    lines += [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs; Python {meta['python']}, torch "
        f"{meta['torch']}, NumPy {meta['numpy']}, numba {meta['numba']}. F32, eps {EPS}.",
        "",
        f"Times: µs per call, median [min, max] of {meta['rounds']} interleaved samples of "
        f"about {meta['sample_ms']} ms each, the order reversed every other round (quartiles "
        "in the JSON). A ratio is of medians; "
        "met = at most its target (issue 17). max |Δ|: the first call's largest difference "
        "from torch in float64 (ok: within atol = rtol = 2e-5); the stand-ins compute nothing. "
        "Of which CuPy stand-in: µs per call spent in the CuPy stand-in's own Python (its "
        "arrays' CUDA array interface, allocations, streams), which a real CuPy replaces; a "
        "'less stand-in' ratio takes it out of both sides (an estimate).",
        "",
    ]
    for sec in report["sections"]:
        rows = sec["rows"]
        if not rows:
            continue
        ways, ratios = list(rows[0]["ways"]), [r["name"] for r in rows[0]["ratios"]]
        share = ["of which CuPy stand-in"] if "stand_ins_us" in rows[0] else []
        lines += [
            f"## {sec['title']}, {sec['threads']} thread{'s' * (sec['threads'] > 1)}",
            "",
            f"loadavg before: `{sec['loadavg'][0]}`; after: `{sec['loadavg'][1]}`",
            "",
            "| " + " | ".join(["shape", "pass", *ways, *share, *ratios, "max |Δ|"]) + " |",
            "|---" * (2 + len(ways) + len(share) + len(ratios) + 1) + "|",
        ]
        for r in rows:
            cells = [f"{tuple(r['shape'])}", r["pass"]]
            for w in r["ways"].values():
                cells.append(f"{w['median_us']:.1f} [{w['min_us']:.1f}, {w['max_us']:.1f}]")
            if share:
                cells.append(", ".join(f"{n} {us:.1f}" for n, us in r["stand_ins_us"].items()))
            for ratio in r["ratios"]:
                cell = f"{ratio['value']:.2f}"
                if ratio["target"] is not None:
                    verdict = "met" if ratio["met"] else "**not met**"
                    cell += f" (≤ {ratio['target']}: {verdict})"
                cells.append(cell)
            cells.append(_accuracy(r["ways"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _accuracy(ways: dict) -> str:
    checked = {n: w for n, w in ways.items() if w["max_abs_diff"] is not None}
    if not checked:
        return "n/a"
    worst = max(w["max_abs_diff"] for w in checked.values())
    bad = [n for n, w in checked.items() if not w["within_tolerance"]]
    return f"{worst:.1e} " + (f"**outside: {', '.join(bad)}**" if bad else "ok")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for .md/.json")
    parser.add_argument("--quick", action="store_true", help="dry run: one problem, 2 rounds")
    parser.add_argument("--rounds", type=int, help="interleaved samples per way (default 15)")
    parser.add_argument("--sample-ms", type=float, help="length of one sample (default 20)")
    parser.add_argument("--threads", default=None, help="comma-separated (default 1,2)")
    parser.add_argument(
        "--batched-only", action="store_true", help="only the batched backward's sections"
    )
    args = parser.parse_args(argv)
    if args.quick and args.out.resolve() == DEFAULT_OUT.resolve():
        parser.error("--quick writes no results into benchmarks/results: give --out")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds = args.rounds or (2 if args.quick else 15)
    sample_ms = args.sample_ms or (1.0 if args.quick else 20.0)
    threads = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    timing = Timing(rounds, sample_ms / 1e3)
    sections: list[dict] = []
    for count in threads:
        numba_threads = set_threads(count)
        if numba_threads != count:
            print(f"note: the CPU engine runs with {numba_threads} threads", file=sys.stderr)
        if not args.batched_only:
            with section("CPU: array API, compute, C API vs torch", count, sections) as rows:
                rows += cpu_rows(shapes, timing)
        with section("CPU: batched backward, B = 64", count, sections) as rows:
            rows += batched_rows(None, shapes, timing)
        with ExitStack() as stack:
            try:
                from stand_ins import device_arrays, forget_allocations

                fake = stack.enter_context(device_arrays())
                on_fake = Timing(rounds, timing.sample_s, lambda f=fake: forget_allocations(f))
            except Exception as exc:  # no gcc, or no pytest: said, not fatal
                print(f"no NVIDIA stand-ins: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            if not args.batched_only:
                with section("NVIDIA path on the stand-ins vs torch CPU", count, sections) as rows:
                    rows += nvidia_rows(fake, shapes, on_fake)
            with section("NVIDIA stand-ins: batched backward, B = 64", count, sections) as rows:
                rows += batched_rows(fake, [*map(on_cudnn, shapes)], on_fake)
    import numba

    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "quick": args.quick,
        "rounds": rounds,
        "sample_ms": sample_ms,
        "command": " ".join(["PYTHONPATH=. python benchmarks/bench_calls.py", *sys.argv[1:]]),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    report = {"meta": meta, "sections": sections}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"calls-{meta['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {stem}.md, .json", file=sys.stderr)
    bad = [
        f"{sec['title']} {tuple(r['shape'])} {r['pass']} {name}"
        for sec in sections
        for r in sec["rows"]
        for name, w in r["ways"].items()
        if not w["within_tolerance"]
    ]
    for line in bad:
        print(f"outside tolerance: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
