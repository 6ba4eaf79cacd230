"""Batch norm, backward and forward: cudnn_bn against PyTorch on the same GPU memory.

Run on the GPU machine from the source tree: ``PYTHONPATH=. python3 benchmarks/bench_bn.py``
(``make bench``). Three passes, each chosen with ``--passes`` (default all): the backward
(every implementation given the mean and invstd that ``aten::cudnn_batch_norm`` saved, as
``aten::cudnn_batch_norm_backward`` is), the training forward and the inference forward.
One process and one non-blocking CuPy stream, which torch shares (``ExternalStream``). GPU
time is taken by CUDA events around each call, after a warm-up and an L2 flush, as the median
(p10, p90) of ``--runs`` calls. Writes ``<out>/<device>-<date>.md`` and ``.json``, and
``.png`` where matplotlib is installed. ``--dry-run`` touches no GPU: placeholder times
drive every table, the JSON and the plot. A training forward updates the running statistics
on every call, so each implementation there has its own running buffers. The passes, their
implementations and the files: ``bench_report.py``; Markdown and plot: ``plot_results.py``.
"""

import argparse
import contextlib
import datetime
import functools
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_report import (
    DRY_RUN_MS,
    DRY_RUN_US,
    PASSES,
    command_line,
    cuda_version,
    driver_version,
    dry_environment,
    dry_row,
    error_text,
    summarize_row,
    write_report,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
DRY_LABEL = "DRY RUN — not measurements"
EPS, MOMENTUM, GIB, MIB = 1e-5, 0.1, 2**30, 2**20
BUDGET, FLUSH_BYTES, SLACK_BYTES = 20 * GIB, 256 * MIB, 256 * MIB
PEAK_TENSORS = 6  # x-sized buffers alive at once: the copy's source and destination (3 each)
CUDNN_MAX_NUMEL = 2**31 - 1
HOST_CALLS = 1000
DEVICE = "cuda"  # torch device of every tensor
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
TRAINING = "forward_training"


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    dtype: str  # f32, f16, bf16
    layout: str  # NCL, NCHW, NHWC

    @property
    def nbytes(self) -> int:
        """Bytes of one data tensor (x, dy, dx or y)."""
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
        f"for per-channel tensors, workspaces, reserves and allocator rounding = {usable} B",
        f"peak = {PEAK_TENSORS} x-sized buffers: the copy phase holds source and destination of "
        "x+dy+dx bytes (3 each); the backward's timing holds at most 5 (x, dy, the reference "
        "dx, and two more: compute's dx and the graph's dx, or autograd's y and x.grad); the "
        "forward's at most 4 (x, the reference y, compute's y and the graph's y)",
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


def make_tensors(case: Case, torch: Any, pass_name: str) -> dict[str, Any]:
    """x, weight, bias and running statistics (and dy for the backward), seeded."""
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    fmt = torch.channels_last if case.layout == "NHWC" else torch.contiguous_format
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    c = case.shape[1]

    def data(mean: float, std: float) -> Any:
        t = torch.empty(case.shape, dtype=dtype, device=DEVICE, memory_format=fmt)
        return t.normal_(mean, std, generator=gen)

    channel = {"device": DEVICE, "dtype": torch.float32}  # cuDNN's and PyTorch's mixed precision
    t = {"x": data(1.0, 3.0)}
    if pass_name == "backward":
        t["dy"] = data(0.0, 1.0)
    t["w"] = torch.empty(c, **channel).uniform_(0.5, 1.5, generator=gen)
    t["b"] = torch.empty(c, **channel).normal_(generator=gen)
    if pass_name == "forward_inference":  # fixed statistics near x's own, read by every call
        t["rm"] = torch.empty(c, **channel).uniform_(0.5, 1.5, generator=gen)
        t["rv"] = torch.empty(c, **channel).uniform_(6.0, 12.0, generator=gen)
    else:  # the backward's forward and every training implementation start from these
        t["rm"], t["rv"] = torch.zeros(c, **channel), torch.ones(c, **channel)
    return t


class Running:
    """One implementation's own running statistics, so that training forwards (each call
    updates them) do not disturb each other; ``reset`` puts back the starting values."""

    def __init__(self, t: dict) -> None:
        self.start = (t["rm"], t["rv"])
        self.mean, self.var = (s.clone() for s in self.start)

    def reset(self) -> None:
        self.mean.copy_(self.start[0])
        self.var.copy_(self.start[1])


@dataclass
class Impl:
    """One implementation bound to its tensors: ``fn`` is the call timed."""

    fn: Callable[[], Any]
    info: dict = field(default_factory=dict)
    running: Running | None = None
    results: tuple | None = None  # the buffers a call writes, where ``fn`` returns nothing
    keep: tuple = ()  # what ``fn`` reaches only by raw pointers: held as long as it is

    def named(self, pass_name: str, out: Any) -> dict[str, Any]:
        """A call's results by name (dx, dw, db; y, mean, invstd; running_mean, ...)."""
        out = self.results if self.results is not None else out
        out = out if isinstance(out, tuple | list) else (out,)
        names = dict(zip(PASSES[pass_name].outputs, out, strict=False))
        if self.running is not None:
            names.update(running_mean=self.running.mean, running_var=self.running.var)
        return names


def tensor_desc(t: Any) -> Any:
    import cudnn_bn

    dt = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[str(t.dtype).split(".")[-1]]
    return cudnn_bn.TensorDesc(cudnn_bn.DataType[dt], tuple(t.shape), tuple(t.stride()))


class OursCompute:
    """A descriptor built once with pre-allocated outputs, workspace (and reserve and running
    statistics in training); eager and CUDA graph. A call passes pre-computed pointers."""

    def __init__(self, pass_name: str, t: dict, bench: Bench) -> None:
        import cudnn_bn

        torch, x, w = bench.torch, t["x"], t["w"]
        device = {"cuda": cudnn_bn.Device.NVIDIA, "cpu": cudnn_bn.Device.CPU}
        handle = cudnn_bn.Handle(device[x.device.type], x.device.index or 0)
        self.pass_name, self.t, self.bench = pass_name, t, bench
        self.running, self.reserve = None, None
        if pass_name == "backward":
            self.outs = [torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)]
            self.ins = [x, t["dy"], w, t["mean"], t["invstd"]]
            self.desc = cudnn_bn.BatchNormBackwardDescriptor(
                handle,
                *map(tensor_desc, self.outs + self.ins),
                eps=EPS,
                mode=cudnn_bn.Mode.SAVED_INVSTD,
            )
        elif pass_name == TRAINING:  # saved statistics: F32 for every input dtype
            self.outs = [torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)]
            self.ins = [x, w, t["b"]]
            self.running = Running(t)
            self.desc = cudnn_bn.BatchNormForwardTrainingDescriptor(
                handle,
                *map(tensor_desc, [*self.outs, *self.ins, self.running.mean, self.running.var]),
                eps=EPS,
                momentum=MOMENTUM,
            )
            reserve_bytes = max(self.desc.reserve_size, 1)
            self.reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=x.device)
        else:
            self.outs = [torch.empty_like(x)]
            self.ins = [x, w, t["b"], t["rm"], t["rv"]]
            self.desc = cudnn_bn.BatchNormForwardInferenceDescriptor(
                handle, *map(tensor_desc, self.outs + self.ins), eps=EPS
            )
        self.ws = torch.empty(max(self.desc.workspace_size, 1), dtype=torch.uint8, device=x.device)

    def _bind(self, outs: list, running: Running | None, reserve: Any) -> Callable[[], None]:
        """``desc.compute`` with every pointer bound: the timed call does nothing else."""
        ptrs = [a.data_ptr() for a in (*outs, *self.ins)]
        if running is not None:
            ptrs += [running.mean.data_ptr(), running.var.data_ptr()]
        if reserve is not None:
            ptrs = [reserve.data_ptr(), self.desc.reserve_size, *ptrs]
        return functools.partial(
            self.desc.compute,
            self.ws.data_ptr(),
            self.desc.workspace_size,
            *ptrs,
            stream=self.bench.stream.ptr,
        )

    def eager(self) -> Impl:
        fn = self._bind(self.outs, self.running, self.reserve)
        info = {"engine": self.desc.engine}
        return Impl(fn, info, self.running, tuple(self.outs), keep=(self,))

    def graph(self) -> Impl:
        """The compute captured on the stream, into its own outputs, running statistics and
        reserve; each replay of the training forward updates its running statistics."""
        stream, torch = self.bench.stream, self.bench.torch
        outs = [torch.empty_like(o) for o in self.outs]
        running = Running(self.t) if self.running is not None else None
        reserve = torch.empty_like(self.reserve) if self.reserve is not None else None
        self._bind(self.outs, self.running, self.reserve)()
        captured = self._bind(outs, running, reserve)
        stream.synchronize()
        stream.begin_capture()
        try:
            captured()
        except BaseException:
            with contextlib.suppress(Exception):
                stream.end_capture()
            raise
        graph = stream.end_capture()
        if hasattr(graph, "upload"):
            graph.upload(stream)
        graph.launch(stream)
        diff = max(max_abs_diff(e, g, torch) for e, g in zip(self.outs, outs, strict=True))
        info = {"replay_vs_eager_max_abs_diff": diff}
        replay = functools.partial(graph.launch, stream)
        return Impl(replay, info, running, tuple(outs), keep=(self, outs, running, reserve))


def torch_impls(pass_name: str, t: dict, torch: Any) -> dict[str, Callable[[], Impl]]:
    """PyTorch's implementations of the pass, each made on demand (own running statistics)."""
    x, w, b, rm, rv = (t[k] for k in ("x", "w", "b", "rm", "rv"))
    aten, F = torch.ops.aten, torch.nn.functional
    if pass_name == "backward":
        dy, mean, invstd = t["dy"], t["mean"], t["invstd"]

        def cudnn() -> Impl:
            if t["reserve"] is None:
                raise RuntimeError(f"aten::cudnn_batch_norm failed: {t['cudnn_error']}")
            args = (x, dy, w, rm, rv, mean, invstd, EPS, t["reserve"])
            return Impl(functools.partial(aten.cudnn_batch_norm_backward, *args))

        def native() -> Impl:
            args = (dy, x, w, rm, rv, mean, invstd, True, EPS, [True, True, True])
            return Impl(functools.partial(aten.native_batch_norm_backward, *args))

        def autograd() -> Impl:
            leaves = [a.detach().requires_grad_() for a in (x, w, b)]
            y = F.batch_norm(
                leaves[0], rm.clone(), rv.clone(), leaves[1], leaves[2], training=True, eps=EPS
            )
            return Impl(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True))

        return {"torch_cudnn": cudnn, "torch_native": native, "torch_autograd": autograd}

    training = pass_name == TRAINING
    ops = {  # op, and whether it takes (input, running_mean, running_var, weight, bias)
        "torch_cudnn": (aten.cudnn_batch_norm, False),
        "torch_native": (aten.native_batch_norm, False),
        "torch_functional": (F.batch_norm, True),
    }

    def maker(op: Callable, functional: bool) -> Callable[[], Impl]:
        def make() -> Impl:
            running = Running(t) if training else None
            m, v = (running.mean, running.var) if running else (rm, rv)
            first = (x, m, v, w, b) if functional else (x, w, b, m, v)
            return Impl(functools.partial(op, *first, training, MOMENTUM, EPS), {}, running)

        return make

    return {key: maker(*spec) for key, spec in ops.items()}


def ours_api(pass_name: str, t: dict, bench: Bench, cupy: bool = True) -> Callable[[], Impl]:
    """The array API on CuPy views of the torch tensors (zero copy; a first call shows that
    cudnn_bn reads them), else, or with ``cupy=False``, on the torch tensors themselves."""
    import cudnn_bn

    common = {"eps": EPS, "stream": bench.stream}
    if pass_name == "backward":
        names = ("x", "dy", "w", "mean", "invstd")

        def bind(x, dy, w, mean, invstd) -> Callable:
            saved = {"saved_mean": mean, "saved_invstd": invstd, "mode": "saved"}
            return functools.partial(
                cudnn_bn.batch_norm_backward, x, dy, w, None, None, **saved, **common
            )
    else:
        names = ("x", "w", "b", "rm", "rv")
        if pass_name == TRAINING:
            common["momentum"] = MOMENTUM
            forward = cudnn_bn.batch_norm_forward_training
        else:
            forward = cudnn_bn.batch_norm_forward_inference

        def bind(*arrays) -> Callable:
            return functools.partial(forward, *arrays, **common)

    def make() -> Impl:
        running = Running(t) if pass_name == TRAINING else None
        own = {"rm": running.mean, "rv": running.var} if running else {}
        tensors = [{**t, **own}[k] for k in names]
        if cupy:
            try:
                fn = bind(*(bench.cp.from_dlpack(a) for a in tensors))
                fn()  # running statistics: reset before the checked first call
                return Impl(fn, {"inputs": "cupy arrays"}, running)
            except Exception as exc:
                info = {"inputs": f"torch tensors (cupy: {error_text(exc)})"}
                return Impl(bind(*tensors), info, running)
        return Impl(bind(*tensors), {"inputs": "torch tensors"}, running)

    return make


def forward_stats(t: dict, torch: Any) -> None:
    """Saved mean/invstd (and cuDNN's reserve) from the forward pass, into ``t``."""
    args = (t["x"], t["w"], t["b"], t["rm"].clone(), t["rv"].clone(), True, MOMENTUM, EPS)
    t["reserve"] = t["cudnn_error"] = None
    try:
        _, t["mean"], t["invstd"], t["reserve"] = torch.ops.aten.cudnn_batch_norm(*args)
    except Exception as exc:
        t["cudnn_error"] = error_text(exc)
        _, t["mean"], t["invstd"] = torch.ops.aten.native_batch_norm(*args)


def _first_call_then_time(bench: Bench, pass_name: str, make: Callable, reference: Any) -> dict:
    impl = make()
    if impl.running is not None:
        impl.running.reset()  # the checked call starts where the reference's did
    out = impl.fn()
    if reference is not None:
        mine = impl.named(pass_name, out)
        for column, names in PASSES[pass_name].checks.items():
            pairs = [(mine[n], reference[n]) for n in names if n in mine and n in reference]
            if pairs:
                diffs = [max_abs_diff(a, b, bench.torch) for a, b in pairs]
                impl.info[f"{column}_max_abs_diff"] = max(diffs)
        del mine
    del out
    return {"samples": bench.time(impl.fn), **impl.info}


def run_impl(bench: Bench, pass_name: str, make: Callable, reference: Any) -> dict:
    """First call checked against the reference, then timed; a failure becomes its message.
    What the implementation allocated is freed (its frame is gone) before the pools are."""
    try:
        result = _first_call_then_time(bench, pass_name, make, reference)
    except Exception as exc:
        result = {"error": error_text(exc)}
    bench.release()
    return result


def _measure_pass(case: Case, pass_name: str, bench: Bench, raw: dict, extra: dict) -> None:
    torch, spec = bench.torch, PASSES[pass_name]
    t = make_tensors(case, torch, pass_name)
    if pass_name == "backward":
        forward_stats(t, torch)
    bench.release()
    makers = {"ours_api": ours_api(pass_name, t, bench), **torch_impls(pass_name, t, torch)}
    reference = None
    for key in ("torch_cudnn", "torch_native"):
        with contextlib.suppress(Exception):
            impl = makers[key]()
            reference, extra["reference"] = impl.named(pass_name, impl.fn()), spec.impls[key]
            break
    for key in ("ours_api", *spec.theirs):
        raw[key] = run_impl(bench, pass_name, makers[key], reference)
    held: list[OursCompute] = []  # compute's descriptor and buffers, reused by the graph

    def compute() -> Impl:
        held.append(OursCompute(pass_name, t, bench))
        return held[0].eager()

    raw["ours_compute"] = run_impl(bench, pass_name, compute, reference)
    extra["engine"] = raw["ours_compute"].get("engine")
    if "ours_graph" not in spec.impls:
        return
    if not held:
        raw["ours_graph"] = {"error": "no compute descriptor: " + raw["ours_compute"]["error"]}
        return
    raw["ours_graph"] = run_impl(bench, pass_name, held[0].graph, reference)


def measure_case(case: Case, bench: Bench, passes: list[str]) -> list[dict]:
    """Copy bandwidth once, then per pass every implementation in turn, one at a time in
    memory; one row per pass."""
    bench.peak = 0
    try:
        copy = {"samples": bench.copy_times(3 * case.nbytes)}
    except Exception as exc:
        copy = {"error": error_text(exc)}
    bench.release()
    copy["measured_peak_bytes"] = bench.peak
    rows = []
    for pass_name in passes:
        print(f"bench_bn: {case.name} {case.shape} {pass_name}", file=sys.stderr, flush=True)
        bench.peak = 0
        raw: dict[str, dict] = {}
        extra: dict[str, Any] = {}
        try:
            _measure_pass(case, pass_name, bench, raw, extra)
        except Exception as exc:
            extra["error"] = error_text(exc)
            for key in PASSES[pass_name].impls:
                raw.setdefault(key, {"error": f"case set-up failed: {extra['error']}"})
        bench.release()
        extra["measured_peak_bytes"] = bench.peak
        rows.append(summarize_row(case, pass_name, copy, raw, extra))
    return rows


def host_overhead(bench: Bench, pass_name: str) -> dict[str, dict]:
    """Wall time per call of HOST_CALLS back-to-back calls on the tiny case, one sync."""
    torch, out = bench.torch, {}
    t = make_tensors(TINY, torch, pass_name)
    if pass_name == "backward":
        forward_stats(t, torch)
    makers = {
        **torch_impls(pass_name, t, torch),
        "ours_api (CuPy arrays)": ours_api(pass_name, t, bench),
        "ours_api (torch tensors)": ours_api(pass_name, t, bench, cupy=False),
        "ours_compute": lambda: OursCompute(pass_name, t, bench).eager(),
    }
    for name in PASSES[pass_name].host_impls:
        try:
            impl = makers[name]()  # held: it keeps the buffers fn writes alive
            fn = impl.fn
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


def host_rows(passes: list[str], overheads: dict[str, dict]) -> list[dict]:
    return [
        {"pass": p, "case": TINY.name, "calls": HOST_CALLS, "impls": overheads[p]} for p in passes
    ]


def run_gpu(args: argparse.Namespace, cases: list[Case]) -> tuple[dict, list[dict], list[dict]]:
    import torch  # noqa: F401  (first: cudnn_bn then finds the libcudnn torch has loaded)

    bench = Bench(args.runs, args.warmup, not args.no_l2_flush)
    with bench.active():
        env = gpu_environment(bench)
        rows = []
        for case in cases:
            rows += measure_case(case, bench, args.passes)
        overheads = {}
        for p in args.passes:
            try:
                overheads[p] = host_overhead(bench, p)
            except Exception as exc:
                overheads[p] = {name: {"error": error_text(exc)} for name in PASSES[p].host_impls}
            bench.release()
    return env, rows, host_rows(args.passes, overheads)


METHOD = [
    "one process; one non-blocking CuPy stream, which torch uses through ExternalStream",
    "GPU time: CUDA events recorded on that stream around each call; the times are medians "
    "(p10, p90) over the timed runs, after the warm-up calls",
    "L2 flush: a 256 MiB buffer is overwritten before each timed call, so no call reads x or "
    "dy from L2 left warm by the call before (off with --no-l2-flush)",
    "every implementation reads the same torch tensors (zero copy; CuPy views by DLPack); "
    "implementations run one at a time, each checked on its first call against the reference "
    "(aten::cudnn_batch_norm[_backward], else aten::native_batch_norm[_backward])",
    "backward: every implementation takes the mean/invstd saved by aten::cudnn_batch_norm "
    "(aten::native_batch_norm where that fails); ours runs mode='saved' with "
    "saved_mean/saved_invstd (Mode.SAVED_INVSTD)",
    f"forward training (momentum {MOMENTUM}): every call updates the running statistics, so "
    "each implementation (and the graph) has its own running mean/var buffers, starting at "
    "0 and 1 and reset before its checked first call; the timed calls keep updating them, "
    "which changes no time. Compared: y, the saved mean/invstd where returned, and the "
    "running statistics after that one call",
    "forward inference: every implementation reads the same fixed running statistics "
    "(read-only); compared: y",
    "per-channel tensors (weight, bias, statistics, dw, db) are F32 for every input dtype, as "
    "cuDNN and PyTorch's mixed precision take them",
    "effective bandwidth counts the least traffic a call needs: backward x and dy read and "
    "dx written; forward x read and y written (a two-pass training forward reads x twice, "
    "which the count leaves out); fraction of a device-to-device copy of x+dy+dx bytes, "
    "measured once per case and counted as read plus write",
    "CUDA graph: the backward and the forward-training compute captured on the CuPy stream "
    "and replayed (a training replay updates the graph's running statistics, as a call does)",
    "event times include host time between the events that the GPU cannot hide (the flush "
    "before each call gives the host a head start of its duration); the host-overhead tables "
    "give the host cost per call directly",
    "measured peak device memory: in use beyond the start of the bench, sampled before each "
    "free of the CuPy and torch pools (which only grow until then); includes library handles",
    "the array API allocates its outputs (and reserve) and its workspace on each call; "
    "descriptor.compute and the graph replay write pre-allocated buffers",
]


def parse_passes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown pass {', '.join(unknown) or '(none)'}; choose from {','.join(PASSES)}"
        )
    return [p for p in PASSES if p in names]


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
    parser.add_argument(
        "--passes",
        type=parse_passes,
        default=list(PASSES),
        metavar="PASS[,PASS...]",
        help=f"comma-separated subset of: {','.join(PASSES)} (default all)",
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
        rows = [dry_row(case, p, args.runs) for case in cases for p in args.passes]
        dry = {p: {n: {"us_per_call": DRY_RUN_US} for n in PASSES[p].host_impls} for p in PASSES}
        host = host_rows(args.passes, dry)
    else:
        env, rows, host = run_gpu(args, cases)
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
        "passes": {p: PASSES[p].to_json() for p in args.passes},
        "rows": rows,
        "host_overhead": host,
        "largest_case_budget": largest_case()[1],
    }
    for path in write_report(report, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
