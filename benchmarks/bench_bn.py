"""Batch-norm backward: cudnn_bn against PyTorch on the same GPU memory (``make bench``).

Run on the GPU machine from the source tree: ``PYTHONPATH=. python3 benchmarks/bench_bn.py``.
One process and one non-blocking CuPy stream, which torch shares (``ExternalStream``). GPU
time is taken by CUDA events around each call, after a warm-up and an L2 flush, as the median
(p10, p90) of ``--runs`` calls. Like for like: every implementation is given the mean and
invstd that ``aten::cudnn_batch_norm`` saved, as ``aten::cudnn_batch_norm_backward`` is.
Writes ``<out>/<device>-<date>.md`` and ``.json``, and ``.png`` where matplotlib is installed.
``--dry-run`` touches no GPU: placeholder times drive every table, the JSON and the plot.
"""

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
DRY_LABEL = "DRY RUN — not measurements"
DRY_RUN_MS, DRY_RUN_US = 1.0, 1.0  # the placeholder every dry-run time is set to
EPS, GIB, MIB = 1e-5, 2**30, 2**20
BUDGET, FLUSH_BYTES, SLACK_BYTES = 20 * GIB, 256 * MIB, 256 * MIB
PEAK_TENSORS = 6  # x-sized buffers alive at once: the copy's source and destination (3 each)
CUDNN_MAX_NUMEL = 2**31 - 1
HOST_CALLS = 1000
DEVICE = "cuda"  # torch device of every tensor
CUDNN_WHEELS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
HOST_IMPLS = ("ours_api (CuPy arrays)", "ours_api (torch tensors)", "ours_compute")
HOST_IMPLS += ("torch_cudnn", "torch_native")
IMPLS = {  # key: label; the first three are ours
    "ours_api": "cudnn_bn array API",
    "ours_compute": "cudnn_bn descriptor.compute",
    "ours_graph": "cudnn_bn compute, CUDA graph replay",
    "torch_cudnn": "torch cudnn_batch_norm_backward",
    "torch_native": "torch native_batch_norm_backward",
    "torch_autograd": "torch autograd (F.batch_norm)",
}
OURS, THEIRS = ("ours_api", "ours_compute"), ("torch_cudnn", "torch_native", "torch_autograd")
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    dtype: str  # f32, f16, bf16
    layout: str  # NCL, NCHW, NHWC

    @property
    def nbytes(self) -> int:
        """Bytes of one data tensor (x, dy or dx)."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def largest_case() -> tuple[Case, list[str]]:
    """The largest F32 NCHW case whose buffers fit in 20 GiB, with the arithmetic."""
    usable = BUDGET - FLUSH_BYTES - SLACK_BYTES
    per_tensor = usable // PEAK_TENSORS
    numel = min(per_tensor // ITEMSIZE["f32"], CUDNN_MAX_NUMEL)
    c, h, w = 64, 112, 112
    n = numel // (c * h * w)
    case = Case("largest_f32_nchw", (n, c, h, w), "f32", "NCHW")
    return case, [
        f"budget 20 GiB = {BUDGET} B, less {FLUSH_BYTES} B L2-flush buffer and {SLACK_BYTES} B "
        f"for per-channel tensors, workspaces and allocator rounding = {usable} B",
        f"peak = {PEAK_TENSORS} x-sized buffers: the copy phase holds source and destination of "
        "x+dy+dx bytes (3 each); the timing phases hold at most 5 (x, dy, the reference dx, "
        "and two more: compute's dx and the graph's dx, or autograd's y and x.grad)",
        f"per buffer <= {usable} / {PEAK_TENSORS} = {per_tensor} B = {per_tensor // 4} f32 "
        f"elements; cuDNN takes numel <= 2^31-1 = {CUDNN_MAX_NUMEL}; numel cap {numel}",
        f"shape (N, {c}, {h}, {w}): N = {numel} // {c * h * w} = {n}; numel {n * c * h * w} "
        f"({case.nbytes / GIB:.3f} GiB per buffer, {PEAK_TENSORS * case.nbytes / GIB:.3f} GiB "
        "at peak)",
    ]


TINY = Case("tiny_f32_1x16x16", (1, 16, 16), "f32", "NCL")
CASES = [
    Case("ncl_f32_32x64x4096", (32, 64, 4096), "f32", "NCL"),
    Case("nchw_f16_256x256x56x56", (256, 256, 56, 56), "f16", "NCHW"),
    Case("nhwc_f16_256x256x56x56", (256, 256, 56, 56), "f16", "NHWC"),
    Case("ncl_f32_8x2048x49", (8, 2048, 49), "f32", "NCL"),
    TINY,
    Case("nchw_bf16_64x256x28x28", (64, 256, 28, 28), "bf16", "NCHW"),
    largest_case()[0],
]


# ---------------------------------------------------------------- figures from samples


def stats(samples: list[float]) -> dict[str, Any]:
    p10, median, p90 = np.percentile(samples, [10, 50, 90])
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90, "runs": len(samples)}


def summarize_case(case: Case, copy: dict, raw: dict[str, dict], extra: dict) -> dict:
    """Per-case figures from raw samples: times, ratios, bandwidth fractions, diffs."""
    moved = 3 * case.nbytes  # x and dy read, dx written
    entry = {
        "name": case.name,
        "shape": list(case.shape),
        "dtype": case.dtype,
        "layout": case.layout,
        "bytes_moved": moved,
        **extra,
    }
    copy_bw = None
    if "samples" in copy:
        entry["copy"] = {**stats(copy["samples"]), "samples": copy["samples"]}
        copy_bw = 2 * moved / (entry["copy"]["median_ms"] * 1e-3)  # read + write
        entry["copy"]["bandwidth_gbps"] = copy_bw / 1e9
    else:
        entry["copy"] = {"status": "unavailable", "error": copy.get("error", "not run")}
    impls = {}
    for key in IMPLS:
        r = raw.get(key, {"error": "not run"})
        if "samples" not in r:
            impls[key] = {"status": "unavailable", "error": r.get("error", "not run")}
            continue
        s = stats(r["samples"])
        bw = moved / (s["median_ms"] * 1e-3)
        impls[key] = {
            "status": "ok",
            **s,
            "bandwidth_gbps": bw / 1e9,
            "bandwidth_fraction": bw / copy_bw if copy_bw else None,
            **{k: v for k, v in r.items() if k != "samples"},
            "samples": r["samples"],
        }
    entry["impls"] = impls
    entry["ratios"] = {
        f"{o}/{t}": impls[o]["median_ms"] / impls[t]["median_ms"]
        if impls[o]["status"] == impls[t]["status"] == "ok"
        else None
        for o in (*OURS, "ours_graph")
        for t in THEIRS
    }
    return entry


# ---------------------------------------------------------------- GPU side


class Bench:
    """One CuPy stream shared with torch, event timing, L2 flush, and memory bookkeeping."""

    def __init__(self, runs: int, warmup: int, flush_l2: bool) -> None:
        import cupy
        import torch

        self.cp, self.torch, self.runs, self.warmup = cupy, torch, runs, warmup
        torch.cuda.init()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.torch_stream = torch.cuda.ExternalStream(self.stream.ptr)
        self.baseline = self.used_bytes()
        self.flush_buf = cupy.empty(FLUSH_BYTES, cupy.uint8) if flush_l2 else None
        self.peak = 0

    @contextlib.contextmanager
    def active(self):
        with self.stream, self.torch.cuda.stream(self.torch_stream):
            yield

    def used_bytes(self) -> int:
        free, total = self.cp.cuda.runtime.memGetInfo()
        return total - free

    def release(self) -> None:
        """Note device memory in use (caching pools only grow until here), then free pools."""
        self.stream.synchronize()
        self.peak = max(self.peak, self.used_bytes() - self.baseline)
        self.cp.get_default_memory_pool().free_all_blocks()
        self.torch.cuda.empty_cache()

    def time(self, fn: Callable[[], Any]) -> list[float]:
        for _ in range(self.warmup):
            fn()
        Event = self.cp.cuda.Event
        pairs = [(Event(), Event()) for _ in range(self.runs)]
        for start, end in pairs:
            if self.flush_buf is not None:
                self.flush_buf.fill(0)
            start.record(self.stream)
            fn()
            end.record(self.stream)
        self.stream.synchronize()
        return [self.cp.cuda.get_elapsed_time(start, end) for start, end in pairs]

    def copy_times(self, nbytes: int) -> list[float]:
        """Times of a device-to-device copy (cudaMemcpyAsync) of ``nbytes``."""
        src, dst = self.cp.ones(nbytes, self.cp.uint8), self.cp.empty(nbytes, self.cp.uint8)
        return self.time(lambda: dst.data.copy_from_device_async(src.data, nbytes, self.stream))


def error_text(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and the first line of its message, at most ``limit`` characters."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:limit]}{'...' if len(first) > limit else ''}"


def max_abs_diff(a: Any, b: Any, torch: Any) -> float:
    """max |a - b| in F32, in slices along axis 0 so that the largest case needs no copy."""
    a, b = (t if isinstance(t, torch.Tensor) else torch.from_dlpack(t) for t in (a, b))
    step = max(1, 2**26 // max(1, a[0].numel()))
    worst = 0.0
    for i in range(0, a.shape[0], step):
        d = (a[i : i + step].float() - b[i : i + step].float()).abs().max().item()
        if math.isnan(d):
            return d
        worst = max(worst, d)
    return worst


def make_tensors(case: Case, torch: Any) -> dict[str, Any]:
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    fmt = torch.channels_last if case.layout == "NHWC" else torch.contiguous_format
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    c = case.shape[1]

    def data(mean: float, std: float) -> Any:
        t = torch.empty(case.shape, dtype=dtype, device=DEVICE, memory_format=fmt)
        return t.normal_(mean, std, generator=gen)

    channel = {"device": DEVICE, "dtype": torch.float32}  # cuDNN's and PyTorch's mixed precision
    return {
        "x": data(1.0, 3.0),
        "dy": data(0.0, 1.0),
        "w": torch.empty(c, **channel).uniform_(0.5, 1.5, generator=gen),
        "b": torch.empty(c, **channel).normal_(generator=gen),
        "rm": torch.zeros(c, **channel),
        "rv": torch.ones(c, **channel),
    }


def tensor_desc(t: Any) -> Any:
    import cudnn_bn

    dt = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[str(t.dtype).split(".")[-1]]
    return cudnn_bn.TensorDesc(cudnn_bn.DataType[dt], tuple(t.shape), tuple(t.stride()))


class OursCompute:
    """A descriptor built once with pre-allocated outputs and workspace; eager and graph."""

    def __init__(self, t: dict, bench: Bench) -> None:
        import cudnn_bn

        torch, x, w = bench.torch, t["x"], t["w"]
        device = {"cuda": cudnn_bn.Device.NVIDIA, "cpu": cudnn_bn.Device.CPU}
        self.bench, self.outs = (
            bench,
            [torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)],
        )
        ins = [x, t["dy"], w, t["mean"], t["invstd"]]
        self.desc = cudnn_bn.BatchNormBackwardDescriptor(
            cudnn_bn.Handle(device[x.device.type], x.device.index or 0),
            *map(tensor_desc, self.outs + ins),
            eps=EPS,
            mode=cudnn_bn.Mode.SAVED_INVSTD,
        )
        self.ws = torch.empty(max(self.desc.workspace_size, 1), dtype=torch.uint8, device=x.device)
        self.in_ptrs = [a.data_ptr() for a in ins]

    def _run(self, outs: list) -> tuple:
        self.desc.compute(
            self.ws.data_ptr(),
            self.desc.workspace_size,
            *(o.data_ptr() for o in outs),
            *self.in_ptrs,
            stream=self.bench.stream.ptr,
        )
        return tuple(outs)

    def eager(self) -> tuple[Callable, dict]:
        return (lambda: self._run(self.outs)), {"engine": self.desc.engine}

    def graph(self) -> tuple[Callable, dict]:
        stream, torch = self.bench.stream, self.bench.torch
        outs = [torch.empty_like(o) for o in self.outs]
        eager = self._run(self.outs)
        stream.begin_capture()
        try:
            self._run(outs)
        except BaseException:
            with contextlib.suppress(Exception):
                stream.end_capture()
            raise
        graph = stream.end_capture()
        if hasattr(graph, "upload"):
            graph.upload(stream)
        graph.launch(stream)
        diff = max(max_abs_diff(e, g, torch) for e, g in zip(eager, outs, strict=True))

        def replay() -> tuple:
            graph.launch(stream)
            return tuple(outs)

        return replay, {"replay_vs_eager_max_abs_diff": diff}


def torch_impls(t: dict, torch: Any) -> dict[str, Callable[[], tuple[Callable, dict]]]:
    x, dy, w, rm, rv, mean, invstd = (t[k] for k in ("x", "dy", "w", "rm", "rv", "mean", "invstd"))
    aten = torch.ops.aten

    def cudnn():
        if t["reserve"] is None:
            raise RuntimeError(f"aten::cudnn_batch_norm failed: {t['cudnn_error']}")
        return (
            lambda: aten.cudnn_batch_norm_backward(
                x, dy, w, rm, rv, mean, invstd, EPS, t["reserve"]
            )
        ), {}

    def native():
        return (
            lambda: aten.native_batch_norm_backward(
                dy, x, w, rm, rv, mean, invstd, True, EPS, [True, True, True]
            )
        ), {}

    def autograd():
        leaves = [a.detach().requires_grad_() for a in (x, w, t["b"])]
        y = torch.nn.functional.batch_norm(
            leaves[0], rm.clone(), rv.clone(), leaves[1], leaves[2], training=True, eps=EPS
        )
        return (lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)), {}

    return {"torch_cudnn": cudnn, "torch_native": native, "torch_autograd": autograd}


def ours_api(t: dict, bench: Bench, cupy: bool = True) -> Callable[[], tuple[Callable, dict]]:
    """The array API on CuPy views of the torch tensors (zero copy; a first call shows that
    cudnn_bn reads them), else, or with ``cupy=False``, on the torch tensors themselves."""
    import cudnn_bn

    def make():
        def bind(x, dy, w, mean, invstd) -> Callable:
            saved = {"saved_mean": mean, "saved_invstd": invstd, "stream": bench.stream}
            call = functools.partial(cudnn_bn.batch_norm_backward, x, dy, w, None, None, **saved)
            return functools.partial(call, eps=EPS, mode="saved")

        tensors = [t[k] for k in ("x", "dy", "w", "mean", "invstd")]
        if cupy:
            try:
                fn = bind(*(bench.cp.from_dlpack(a) for a in tensors))
                fn()
                return fn, {"inputs": "cupy arrays"}
            except Exception as exc:
                return bind(*tensors), {"inputs": f"torch tensors (cupy: {error_text(exc)})"}
        return bind(*tensors), {"inputs": "torch tensors"}

    return make


def forward_stats(t: dict, torch: Any) -> None:
    """Saved mean/invstd (and cuDNN's reserve) from the forward pass, into ``t``."""
    args = (t["x"], t["w"], t["b"], t["rm"].clone(), t["rv"].clone(), True, 0.1, EPS)
    t["reserve"] = t["cudnn_error"] = None
    try:
        _, t["mean"], t["invstd"], t["reserve"] = torch.ops.aten.cudnn_batch_norm(*args)
    except Exception as exc:
        t["cudnn_error"] = error_text(exc)
        _, t["mean"], t["invstd"] = torch.ops.aten.native_batch_norm(*args)


def _first_call_then_time(bench: Bench, make: Callable, reference: Any) -> dict:
    fn, extra = make()
    out = fn()
    if reference is not None:
        torch = bench.torch
        extra["dx_max_abs_diff"] = max_abs_diff(out[0], reference[0], torch)
        extra["dwdb_max_abs_diff"] = max(max_abs_diff(out[i], reference[i], torch) for i in (1, 2))
    del out
    return {"samples": bench.time(fn), **extra}


def run_impl(bench: Bench, make: Callable, reference: Any) -> dict:
    """First call checked against the reference, then timed; a failure becomes its message.
    What the implementation allocated is freed (its frame is gone) before the pools are."""
    try:
        result = _first_call_then_time(bench, make, reference)
    except Exception as exc:
        result = {"error": error_text(exc)}
    bench.release()
    return result


def _measure_impls(case: Case, bench: Bench, raw: dict, extra: dict) -> None:
    torch = bench.torch
    t = make_tensors(case, torch)
    forward_stats(t, torch)
    bench.release()
    makers = {"ours_api": ours_api(t, bench), **torch_impls(t, torch)}
    reference = None
    for key in ("torch_cudnn", "torch_native"):
        with contextlib.suppress(Exception):
            reference, extra["reference"] = makers[key]()[0](), IMPLS[key]
            break
    for key in ("ours_api", *THEIRS):
        raw[key] = run_impl(bench, makers[key], reference)
    held: list[OursCompute] = []  # compute's descriptor and buffers, reused by the graph

    def compute() -> tuple[Callable, dict]:
        held.append(OursCompute(t, bench))
        return held[0].eager()

    raw["ours_compute"] = run_impl(bench, compute, reference)
    extra["engine"] = raw["ours_compute"].get("engine")
    if not held:
        raw["ours_graph"] = {"error": "no compute descriptor: " + raw["ours_compute"]["error"]}
        return
    raw["ours_graph"] = run_impl(bench, held[0].graph, reference)


def measure_case(case: Case, bench: Bench) -> dict:
    """Copy bandwidth, then every implementation in turn, one at a time in memory."""
    bench.peak = 0
    try:
        copy = {"samples": bench.copy_times(3 * case.nbytes)}
    except Exception as exc:
        copy = {"error": error_text(exc)}
    bench.release()
    raw: dict[str, dict] = {}
    extra: dict[str, Any] = {}
    try:
        _measure_impls(case, bench, raw, extra)
    except Exception as exc:
        extra["error"] = error_text(exc)
        for key in IMPLS:
            raw.setdefault(key, {"error": f"case set-up failed: {extra['error']}"})
    bench.release()
    extra["measured_peak_bytes"] = bench.peak
    return summarize_case(case, copy, raw, extra)


def host_overhead(bench: Bench) -> dict[str, dict]:
    """Wall time per call of HOST_CALLS back-to-back calls on the tiny case, one sync."""
    torch, out = bench.torch, {}
    t = make_tensors(TINY, torch)
    forward_stats(t, torch)
    makers = {
        **torch_impls(t, torch),
        "ours_api (CuPy arrays)": ours_api(t, bench),
        "ours_api (torch tensors)": ours_api(t, bench, cupy=False),
        "ours_compute": lambda: OursCompute(t, bench).eager(),
    }
    for name in HOST_IMPLS:
        try:
            fn, _ = makers[name]()
            for _ in range(bench.warmup):
                fn()
            bench.stream.synchronize()
            start = time.perf_counter()
            for _ in range(HOST_CALLS):
                fn()
            bench.stream.synchronize()
            out[name] = {"us_per_call": (time.perf_counter() - start) / HOST_CALLS * 1e6}
        except Exception as exc:
            out[name] = {"error": error_text(exc)}
    return out


def cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def driver_version() -> str:
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  ..."
    with contextlib.suppress(OSError, StopIteration):
        words = Path("/proc/driver/nvidia/version").read_text().split()
        return next(w for w in words if re.fullmatch(r"\d+\.\d+(\.\d+)?", w))
    with contextlib.suppress(Exception):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    return "unknown"


def gpu_environment(bench: Bench) -> dict:
    import cudnn_bn

    rt, torch = bench.cp.cuda.runtime, bench.torch
    props = rt.getDeviceProperties(rt.getDevice())
    try:
        info = cudnn_bn.cudnn_info()
        cudnn = f"{info.version_string} ({info.path}, found via {info.found_via})"
    except Exception as exc:
        cudnn = f"not loaded: {error_text(exc)}"
    return {
        "device": props["name"].decode(),
        "compute capability": f"{props['major']}.{props['minor']}",
        "device memory": f"{props['totalGlobalMem'] / GIB:.1f} GiB",
        "driver": driver_version(),
        "CUDA (driver API)": cuda_version(rt.driverGetVersion()),
        "CUDA runtime (CuPy)": cuda_version(rt.runtimeGetVersion()),
        "cuDNN (cudnn_bn)": cudnn,
        "cuDNN (torch)": str(torch.backends.cudnn.version()),
        "CuPy": bench.cp.__version__,
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
    }


def dry_environment() -> dict:
    def installed(*names: str) -> str:
        for name in names:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return f"{name} {metadata.version(name)}"
        return "not installed"

    not_run = "n/a (dry run)"
    return {
        "device": "none (dry run)",
        "driver": not_run,
        "CUDA runtime (CuPy)": not_run,
        "cuDNN (cudnn_bn)": f"not loaded (dry run); {installed(*CUDNN_WHEELS)}",
        "CuPy": installed("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "torch": installed("torch"),
    }


def dry_case(case: Case, runs: int) -> dict:
    samples = [DRY_RUN_MS] * runs
    raw = {key: {"samples": samples} for key in IMPLS}
    extra = {"engine": "n/a (dry run)", "reference": "n/a (dry run)", "measured_peak_bytes": None}
    return summarize_case(case, {"samples": samples}, raw, extra)


def run_gpu(args: argparse.Namespace, cases: list[Case]) -> tuple[dict, list[dict], dict]:
    import torch  # noqa: F401  (first: cudnn_bn then finds the libcudnn torch has loaded)

    bench = Bench(args.runs, args.warmup, not args.no_l2_flush)
    with bench.active():
        env = gpu_environment(bench)
        results = []
        for case in cases:
            print(f"bench_bn: {case.name} {case.shape}", file=sys.stderr, flush=True)
            results.append(measure_case(case, bench))
        try:
            overhead = host_overhead(bench)
        except Exception as exc:
            overhead = {name: {"error": error_text(exc)} for name in HOST_IMPLS}
    return env, results, overhead


METHOD = [
    "one process; one non-blocking CuPy stream, which torch uses through ExternalStream",
    "GPU time: CUDA events recorded on that stream around each call; the times are medians "
    "(p10, p90) over the timed runs, after the warm-up calls",
    "L2 flush: a 256 MiB buffer is overwritten before each timed call, so no call reads x or "
    "dy from L2 left warm by the call before (off with --no-l2-flush)",
    "every implementation reads the same torch tensors (zero copy; CuPy views by DLPack) and "
    "the mean/invstd saved by aten::cudnn_batch_norm (aten::native_batch_norm where that "
    "fails); ours runs mode='saved' with saved_mean/saved_invstd (Mode.SAVED_INVSTD)",
    "per-channel tensors (weight, statistics, dw, db) are F32 for every input dtype, as cuDNN "
    "and PyTorch's mixed precision take them",
    "event times include host time between the events that the GPU cannot hide (the flush "
    "before each call gives the host a head start of its duration); the host-overhead table "
    "gives the host cost per call directly",
    "measured peak device memory: in use beyond the start of the bench, sampled before each "
    "free of the CuPy and torch pools (which only grow until then); includes library handles",
    "the array API allocates dx, dw, db and its workspace on each call; descriptor.compute "
    "and the graph replay write pre-allocated buffers",
]


def command_line() -> str:
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return prefix + shlex.join([Path(sys.executable).name, *sys.argv])


def json_safe(value: Any) -> Any:
    """NaN and infinities become null, so that the file is strict JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    return value


def write_report(report: dict, out: Path) -> list[Path]:
    sys.path.insert(0, str(HERE))
    import plot_results

    slug = re.sub(r"[^a-z0-9]+", "-", report["environment"]["device"].lower()).strip("-")
    stem = out / f"{'dry-run' if report['dry_run'] else slug}-{report['environment']['date']}"
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    report = json_safe(report)
    json_path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    md_path.write_text(plot_results.render_markdown(report) + "\n")
    paths = [json_path, md_path]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            f"bench_bn: no matplotlib here; plot later with\n"
            f"  python3 benchmarks/plot_results.py {json_path}",
            file=sys.stderr,
        )
    else:
        paths.append(plot_results.plot(json_path))
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="default benchmarks/results (dry run: a tmp dir)")
    parser.add_argument("--runs", type=int, default=100, help="timed runs per figure (>= 50)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first (>= 10)")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=[c.name for c in CASES],
        metavar="CASE",
        help=f"a subset of: {', '.join(c.name for c in CASES)}",
    )
    parser.add_argument("--dry-run", action="store_true", help="no GPU; placeholder times")
    parser.add_argument("--no-l2-flush", action="store_true", help="do not flush L2 between runs")
    args = parser.parse_args(argv)
    if args.runs < 50 or args.warmup < 10:
        parser.error("--runs must be >= 50 and --warmup >= 10")
    if not args.dry_run:
        args.out = args.out or DEFAULT_OUT
    elif args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="bench_bn_dry_run_"))
    elif args.out.resolve() == DEFAULT_OUT.resolve():
        parser.error("a dry run writes no placeholder figures into benchmarks/results")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    if args.dry_run:
        env = dry_environment()
        results = [dry_case(case, args.runs) for case in cases]
        overhead = {name: {"us_per_call": DRY_RUN_US} for name in HOST_IMPLS}
    else:
        env, results, overhead = run_gpu(args, cases)
    env |= {
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "Python": platform.python_version(),
        "command": command_line(),
        "runs / warm-up": f"{args.runs} / {args.warmup}",
        "L2 flush": "off" if args.no_l2_flush else f"{FLUSH_BYTES // MIB} MiB",
    }
    report = {
        "label": DRY_LABEL if args.dry_run else "measurements",
        "dry_run": args.dry_run,
        "dry_run_note": f"Every time in this file is the placeholder {DRY_RUN_MS} ms (host "
        f"overhead {DRY_RUN_US} µs) that --dry-run writes to exercise the report; no GPU was "
        "used and nothing was measured."
        if args.dry_run
        else None,
        "environment": env,
        "method": METHOD,
        "impls": IMPLS,
        "cases": results,
        "host_overhead": {"case": TINY.name, "calls": HOST_CALLS, "impls": overhead},
        "largest_case_budget": largest_case()[1],
    }
    for path in write_report(report, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
