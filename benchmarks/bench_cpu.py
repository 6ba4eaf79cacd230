"""The CPU engine against torch CPU and plain float32 NumPy, side by side in one process.

Run from the source tree: ``PYTHONPATH=. python benchmarks/bench_cpu.py [--out DIR]
[--quick] [--runs N] [--threads T] [--cases NAME ...]``. For every case (shape, dtype,
layout) and pass (backward with saved statistics, training forward, inference forward) it
times cudnn_bn's array API, torch (``torch.ops.aten.native_batch_norm_backward``,
``torch.nn.functional.batch_norm``) and a dozen lines of float32 NumPy on the same memory,
the implementations interleaved run by run; the per-call cases also time a cached
descriptor's ``compute``. ``--threads`` sets both libraries' thread count (torch's and the
CPU engine's, ``cpu_pool.set_thread_count``). Times are medians with min and max; every
implementation's result is checked against torch in float64 in the same run. Writes
``<out>/cpu-<date>.md``, ``.json`` and ``.png`` (the plot needs matplotlib; without it the
plot is skipped with a message). ``--quick`` is a dry mode on tiny shapes (a test runs it);
its files say so and it refuses to write into ``benchmarks/results``.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F
from interleaving import alternating

import cudnn_bn
from cudnn_bn import DataType
from cudnn_bn.backends import cpu, cpu_pool
from cudnn_bn.ops.batch_norm_backward import BatchNormBackwardDescriptor
from cudnn_bn.ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from cudnn_bn.ops.batch_norm_forward_training import BatchNormForwardTrainingDescriptor
from cudnn_bn.runtime import Handle
from cudnn_bn.tensor import TensorDesc

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
EPS, MOMENTUM = 1e-5, 0.1
PASSES = ("backward", "forward_training", "forward_inference")
TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
TORCH_DTYPES["f64"] = torch.float64
DATA_TYPES = {"f16": DataType.F16, "bf16": DataType.BF16, "f32": DataType.F32}
DATA_TYPES["f64"] = DataType.F64
TOL = {"f16": 1e-2, "bf16": 1e-2, "f32": 2e-5, "f64": 1e-10}
PER_CALL_TARGET = 2.0  # the array API's per-call time / torch's, on the tiny cases
SETTLE_S = 0.005  # idle time before each timed sample (not timed)
TARGET = {"f16": 1.5, "bf16": 1.5, "f32": 1.0, "f64": 1.0}  # our time / torch's (issue 10)


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = "NCHW"  # or NHWC (channels-last)
    calls: int = 1  # calls per timed sample: many for the per-call (overhead) cases


CASES = [
    Case("f32_32x64x4096", (32, 64, 4096), "f32"),
    Case("f32_64x256x28x28_nchw", (64, 256, 28, 28), "f32"),
    Case("f32_64x256x28x28_nhwc", (64, 256, 28, 28), "f32", "NHWC"),
    Case("f32_8x2048x49", (8, 2048, 49), "f32"),
    Case("f16_64x256x28x28", (64, 256, 28, 28), "f16"),
    Case("bf16_64x256x28x28", (64, 256, 28, 28), "bf16"),
    Case("f64_32x64x4096", (32, 64, 4096), "f64"),
    Case("f64_64x256x28x28_nhwc", (64, 256, 28, 28), "f64", "NHWC"),
    # Channels-last at few, some and many channels, 1e6 to 1e8 values (issue 18).
    Case("f32_16x3x144x144_nhwc", (16, 3, 144, 144), "f32", "NHWC"),
    Case("f32_64x3x224x224_nhwc", (64, 3, 224, 224), "f32", "NHWC"),
    Case("f32_16x64x32x32_nhwc", (16, 64, 32, 32), "f32", "NHWC"),
    Case("f32_32x64x56x56_nhwc", (32, 64, 56, 56), "f32", "NHWC"),
    Case("f32_128x64x112x112_nhwc", (128, 64, 112, 112), "f32", "NHWC"),
    Case("f32_32x512x8x8_nhwc", (32, 512, 8, 8), "f32", "NHWC"),
    Case("f32_128x512x14x14_nhwc", (128, 512, 14, 14), "f32", "NHWC"),
    Case("f32_1x16x16_per_call", (1, 16, 16), "f32", calls=100),
    Case("f32_8x4_per_call", (8, 4), "f32", calls=100),
]
QUICK_CASES = [
    Case("f32_4x8x32", (4, 8, 32), "f32"),
    Case("f32_4x8x4x4_nhwc", (4, 8, 4, 4), "f32", "NHWC"),
    Case("f32_4x3x4x4_nhwc", (4, 3, 4, 4), "f32", "NHWC"),
    Case("f16_4x8x16", (4, 8, 16), "f16"),
    Case("bf16_4x8x16", (4, 8, 16), "bf16"),
    Case("f64_4x8x16", (4, 8, 16), "f64"),
    Case("f32_8x4_per_call", (8, 4), "f32", calls=3),
]


# --- operands ----------------------------------------------------------------------------


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (same memory and strides); BF16 as ml_dtypes.bfloat16."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def make_operands(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random x, dy, z (the data dtype and layout), per-channel tensors (F32 for half data)
    and the statistics torch's training forward saves."""
    gen = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[case.dtype]
    pc_dt = torch.float32 if case.dtype in ("f16", "bf16") else dt
    c = case.shape[1]
    per_channel = (1, c) + (1,) * (len(case.shape) - 2)

    def data(scale: float, shift: float) -> torch.Tensor:
        t = torch.randn(case.shape, generator=gen, dtype=torch.float64) * scale + shift
        t = t * torch.rand(per_channel, generator=gen, dtype=torch.float64).add(0.5)
        t = t.to(dt)
        if case.layout == "NHWC":
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    def channel(low: float, high: float) -> torch.Tensor:
        return (torch.rand(c, generator=gen, dtype=torch.float64) * (high - low) + low).to(pc_dt)

    ops = {"x": data(1.0, 0.5), "dy": data(1.0, 0.0)}
    ops.update(w=channel(0.5, 1.5), b=channel(-0.5, 0.5), rm=channel(-0.5, 0.5))
    ops["rv"] = channel(0.5, 2.0)
    _, mean, invstd = torch.ops.aten.native_batch_norm(
        ops["x"], ops["w"], ops["b"], None, None, True, MOMENTUM, EPS
    )
    ops.update(mean=mean.to(pc_dt), invstd=invstd.to(pc_dt))
    return ops


# --- implementations ---------------------------------------------------------------------


def torch_impls(ops: dict) -> dict[str, Callable[[], tuple]]:
    x, dy, w, b, mean, invstd = (ops[n] for n in ("x", "dy", "w", "b", "mean", "invstd"))
    rm, rv = ops["rm"].clone(), ops["rv"].clone()
    return {
        "backward": lambda: torch.ops.aten.native_batch_norm_backward(
            dy, x, w, None, None, mean, invstd, True, EPS, [True, True, True]
        ),
        "forward_training": lambda: (F.batch_norm(x, rm, rv, w, b, True, MOMENTUM, EPS),),
        "forward_inference": lambda: (F.batch_norm(x, ops["rm"], ops["rv"], w, b, False, 0, EPS),),
    }


def ours_impls(ops: dict) -> dict[str, Callable[[], tuple]]:
    n = {k: to_numpy(v) for k, v in ops.items()}
    rm, rv = n["rm"].copy(), n["rv"].copy()
    return {
        "backward": lambda: cudnn_bn.batch_norm_backward(
            n["x"],
            n["dy"],
            n["w"],
            None,
            None,
            mode="saved",
            saved_mean=n["mean"],
            saved_invstd=n["invstd"],
            eps=EPS,
        ),
        "forward_training": lambda: cudnn_bn.batch_norm_forward_training(
            n["x"], n["w"], n["b"], rm, rv, momentum=MOMENTUM, eps=EPS
        )[:1],
        "forward_inference": lambda: (
            cudnn_bn.batch_norm_forward_inference(
                n["x"], n["w"], n["b"], n["rm"], n["rv"], eps=EPS
            ),
        ),
    }


def compute_impls(ops: dict) -> dict[str, Callable[[], tuple]]:
    """A cached descriptor's ``compute`` on preallocated outputs: the per-call floor."""
    n = {k: to_numpy(v) for k, v in ops.items()}
    x, pc = n["x"], n["w"]

    def desc(a: np.ndarray) -> TensorDesc:
        dtype = DataType.BF16 if a.dtype.name == "bfloat16" else cudnn_bn.dtypes.from_numpy(a.dtype)
        return TensorDesc(dtype, a.shape, tuple(s // a.itemsize for s in a.strides))

    dx, y, y2 = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    gw, gb, sm, si = (np.empty_like(pc) for _ in range(4))
    rm, rv = n["rm"].copy(), n["rv"].copy()
    xd, pd, handle = desc(x), desc(pc), Handle(cudnn_bn.Device.CPU, 0)
    bwd = BatchNormBackwardDescriptor(handle, xd, pd, pd, xd, xd, pd, pd, pd, mode="saved_invstd")
    fwd = BatchNormForwardTrainingDescriptor(handle, xd, pd, pd, xd, pd, pd, pd, pd)
    inf = BatchNormForwardInferenceDescriptor(handle, xd, xd, pd, pd, pd, pd)
    # Addresses taken once, as a C caller holding its buffers would; the lambdas hold ``outs``
    # (a buffer only an address refers to would be freed under the kernel).
    p = {k: a.ctypes.data for k, a in n.items()}
    outs = dict(dx=dx, gw=gw, gb=gb, y=y, sm=sm, si=si, y2=y2, rm_out=rm, rv_out=rv)
    p.update({k: a.ctypes.data for k, a in outs.items()})
    backward = (p["dx"], p["gw"], p["gb"], p["x"], p["dy"], p["w"], p["mean"], p["invstd"])
    training = (p["y"], p["sm"], p["si"], p["x"], p["w"], p["b"], p["rm_out"], p["rv_out"])
    inference = (p["y2"], p["x"], p["w"], p["b"], p["rm"], p["rv"])
    return {
        "backward": lambda: bwd.compute(0, 0, *backward) or (outs["dx"], outs["gw"], outs["gb"]),
        "forward_training": lambda: fwd.compute(0, 0, 0, 0, *training) or (outs["y"],),
        "forward_inference": lambda: inf.compute(0, 0, *inference) or (outs["y2"],),
    }


def numpy_impls(ops: dict) -> dict[str, Callable[[], tuple]]:
    """What a user would write: float32 NumPy (half data converted to float32 first)."""
    n = {k: to_numpy(v) for k, v in ops.items()}
    axes = (0, *range(2, n["x"].ndim))
    shape = (1, -1) + (1,) * (n["x"].ndim - 2)
    f32 = {
        k: np.asarray(v, dtype=np.float64 if v.dtype == np.float64 else np.float32)
        for k, v in n.items()
    }
    rm, rv = f32["rm"].copy(), f32["rv"].copy()
    out_dtype = n["x"].dtype

    def backward():
        x, dy = np.asarray(n["x"], f32["w"].dtype), np.asarray(n["dy"], f32["w"].dtype)
        mean, invstd, w = (f32[k].reshape(shape) for k in ("mean", "invstd", "w"))
        xhat = (x - mean) * invstd
        gb, gw = dy.sum(axes), (dy * xhat).sum(axes)
        count = x.size // x.shape[1]
        dx = (w * invstd) * (dy - gb.reshape(shape) / count - xhat * (gw.reshape(shape) / count))
        return dx.astype(out_dtype), gw, gb

    def forward_training():
        x = np.asarray(n["x"], f32["w"].dtype)
        mean, var = x.mean(axes), x.var(axes)
        invstd = 1 / np.sqrt(var + EPS)
        w, b = f32["w"], f32["b"]
        y = (x - mean.reshape(shape)) * (w * invstd).reshape(shape) + b.reshape(shape)
        count = x.size // x.shape[1]
        rm[...] = (1 - MOMENTUM) * rm + MOMENTUM * mean
        rv[...] = (1 - MOMENTUM) * rv + MOMENTUM * var * count / (count - 1)
        return (y.astype(out_dtype),)

    def forward_inference():
        x = np.asarray(n["x"], f32["w"].dtype)
        scale = f32["w"] / np.sqrt(f32["rv"] + EPS)
        y = x * scale.reshape(shape) + (f32["b"] - f32["rm"] * scale).reshape(shape)
        return (y.astype(out_dtype),)

    return {
        "backward": backward,
        "forward_training": forward_training,
        "forward_inference": forward_inference,
    }


def references(ops: dict) -> dict[str, tuple[torch.Tensor, ...]]:
    """torch in float64 on the same (rounded) values."""
    d = {k: v.to(torch.float64) for k, v in ops.items()}
    return {
        "backward": torch.ops.aten.native_batch_norm_backward(
            d["dy"], d["x"], d["w"], None, None, d["mean"], d["invstd"], True, EPS, [True] * 3
        ),
        "forward_training": (
            F.batch_norm(d["x"], d["rm"].clone(), d["rv"].clone(), d["w"], d["b"], True, 0.1, EPS),
        ),
        "forward_inference": (F.batch_norm(d["x"], d["rm"], d["rv"], d["w"], d["b"], False),),
    }


def max_error(got: tuple, want: tuple, tol: float) -> tuple[float, bool]:
    """Largest |got - want| over all results, and whether all are within atol = rtol = tol."""
    worst, ok = 0.0, True
    for g, r in zip(got, want, strict=False):
        g = g if isinstance(g, torch.Tensor) else torch.from_numpy(np.asarray(g, np.float64))
        g = g.to(torch.float64).reshape(r.shape)
        diff = (g - r).abs()
        worst = max(worst, float(diff.max()))
        ok = ok and bool((diff <= tol + tol * r.abs()).all())
    return worst, ok


# --- timing ------------------------------------------------------------------------------


def time_case(case: Case, runs: int, with_compute: bool) -> list[dict]:
    """Every pass of ``case``: each implementation's times (interleaved) and accuracy."""
    ops = make_operands(case)
    impls = {"cudnn_bn": ours_impls(ops), "torch": torch_impls(ops), "numpy": numpy_impls(ops)}
    if with_compute:
        impls["cudnn_bn_compute"] = compute_impls(ops)
    want = references(ops)
    rows = []
    for pass_name in PASSES:
        fns = {name: impl[pass_name] for name, impl in impls.items()}
        accuracy = {}
        for name, fn in fns.items():  # warm-up (JIT, caches) and the accuracy check
            for _ in range(cpu.STEPWISE_CALLS):  # the CPU engine's first calls, step by step
                fn()
            accuracy[name] = max_error(fn(), want[pass_name], TOL[case.dtype])
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for run in range(runs):
            for name, fn in alternating(fns, run):
                time.sleep(SETTLE_S)  # the previous library's spinning threads go idle
                start = time.perf_counter()
                for _ in range(case.calls):
                    fn()
                samples[name].append((time.perf_counter() - start) / case.calls)
        row = {"case": case.name, "shape": list(case.shape), "dtype": case.dtype}
        row.update(layout=case.layout, pass_=pass_name, impls={})
        for name, times in samples.items():
            err, ok = accuracy[name]
            row["impls"][name] = {
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "max_abs_error": err,
                "within_tolerance": ok,
            }
        torch_median = row["impls"]["torch"]["median_s"]
        row["ratio_vs_torch"] = {
            name: r["median_s"] / torch_median for name, r in row["impls"].items()
        }
        row["target"] = TARGET[case.dtype]
        if with_compute:  # per call: the array API within 2x, a cached descriptor within 1x
            row["target"], row["compute_target"] = PER_CALL_TARGET, TARGET[case.dtype]
        rows.append(row)
        print(summary_line(row), flush=True)
    return rows


# --- report ------------------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def summary_line(row: dict) -> str:
    r, im = row["ratio_vs_torch"], row["impls"]
    extra = f" compute {r['cudnn_bn_compute']:.2f}x" if "cudnn_bn_compute" in r else ""
    return (
        f"{row['case']:26s} {row['pass_']:18s} ours {fmt_time(im['cudnn_bn']['median_s'])}"
        f" torch {fmt_time(im['torch']['median_s'])} -> {r['cudnn_bn']:.2f}x"
        f" (numpy {r['numpy']:.2f}x){extra}"
    )


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# CPU engine vs torch CPU ({meta['date']})", ""]
    if meta["quick"]:
        lines += ["**QUICK DRY RUN: tiny shapes, not measurements.**", ""]
    lines += [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs; threads: {meta['threads']} "
        f"(torch and cudnn_bn); torch {meta['torch']}, NumPy {meta['numpy']}, "
        f"numba {meta['numba']}; {meta['runs']} interleaved runs per implementation, the "
        "order reversed every other run.",
        "",
        f"Each sample follows {SETTLE_S * 1e3:.0f} ms idle, so that the OpenMP threads of the "
        "previous implementation (torch's, numba's) stop spinning before the next one runs.",
        "",
        "Ratio = median time / torch's median time (target: <= 1.0 F32/F64, <= 1.5 F16/BF16; "
        "per-call cases: array API <= 2.0 and a cached descriptor's compute <= 1.0).",
        "Times: median [min, max]. Error: max |result - torch float64| over all outputs; "
        "ok = within atol = rtol = tolerance (2e-5 F32, 1e-2 F16/BF16, 1e-10 F64).",
        "",
        "| case | pass | cudnn_bn | torch | numpy f32 | ratio | numpy ratio | compute ratio "
        "| target met | error (ours) | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        im, r = row["impls"], row["ratio_vs_torch"]

        def cell(name: str, im: dict = im) -> str:
            t = im[name]
            return f"{fmt_time(t['median_s'])} [{fmt_time(t['min_s'])}, {fmt_time(t['max_s'])}]"

        compute = f"{r['cudnn_bn_compute']:.2f}" if "cudnn_bn_compute" in r else ""
        met = r["cudnn_bn"] <= row["target"]
        met = met and r.get("cudnn_bn_compute", 0) <= row.get("compute_target", 1)
        met = "yes" if met else "**no**"
        ours = im["cudnn_bn"]
        lines.append(
            f"| {row['case']} | {row['pass_']} | {cell('cudnn_bn')} | {cell('torch')} "
            f"| {cell('numpy')} | {r['cudnn_bn']:.2f} | {r['numpy']:.2f} | {compute} | {met} "
            f"| {ours['max_abs_error']:.2e} | {'yes' if ours['within_tolerance'] else '**NO**'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    labels = [f"{r['case']}\n{r['pass_']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.45), 5))
    xs = np.arange(len(rows))
    for offset, name in ((-0.2, "cudnn_bn"), (0.2, "numpy")):
        ax.bar(xs + offset, [r["ratio_vs_torch"][name] for r in rows], 0.4, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("time / torch time")
    ax.set_xticks(xs, labels, rotation=90, fontsize=6)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="dry mode: tiny shapes, 2 runs")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cases", nargs="*", help="only the cases with these names")
    args = parser.parse_args(argv)
    if args.quick and args.out.resolve() == DEFAULT_OUT.resolve():
        parser.error("--quick writes no results into benchmarks/results: give --out")
    torch.set_num_threads(args.threads)
    cpu_pool.set_thread_count(args.threads)
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    runs = args.runs or (2 if args.quick else 15)
    rows = []
    for case in cases:
        rows += time_case(case, runs, with_compute=case.calls > 1)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    meta = {
        "date": date,
        "quick": args.quick,
        "runs": runs,
        "threads": args.threads,
        "command": " ".join(["python", *sys.argv]),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cpu-{date}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(markdown(rows, meta))
    plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.md, .json", file=sys.stderr)
    bad = [
        r["case"] + "/" + r["pass_"] for r in rows if not r["impls"]["cudnn_bn"]["within_tolerance"]
    ]
    if bad:
        print(f"outside tolerance: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
