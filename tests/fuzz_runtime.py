"""Fuzz target: the CPU engine's runtime (``test_fuzz.py`` runs it in a child process).

Each example draws a valid problem: a shape (N = 1 and odd sizes, few or many channels),
each data tensor's layout (NCHW, channels-last, padded; one each: mixed), the data dtype
(F16, BF16, F32, F64) and the per-channel one, NumPy (inputs read-only) or torch arrays, a
pass (training forward, plain or fused ReLU / add-ReLU; inference; backward from batch,
running or saved statistics, with an output mask), ``out=`` arrays or none. And a runtime:
the thread count (1-3); the path, by the engine's thresholds set for the example
(``cpu.PARALLEL_MIN_VALUES``, ``THREADS_MIN_VALUES``, ``ITEM_MIN_VALUES``, ``STEPWISE_CALLS``)
so that small problems take the one-call pass, the first calls' steps or the threaded
passes (blocks of channels, work items of rows); 1-4 Python threads making the call at once
on the shared inputs, each with outputs of its own; now and then another thread flipping
``cpu_pool.set_thread_count`` meanwhile; rarely (1 in ``FORK_ONE_IN``) a fork after the
calls or while they make their plans, whose child makes a plan of its own and a threaded call.

Invariants (README, Threads and First use): a result is bit for bit the same call's at 1
thread with the engine's own thresholds (blocks of channels on threads, the one-call pass
and the first calls' steps give exactly that), but for a call on work items of rows
(``cpu_kernels.rows_pass``: the items' sums added in item order), which is bit for bit the
lone call's at its thread count; every result is within ``helpers.TOL`` of torch's float64
("wrong"); the inputs are unchanged ("half_writes"); every call returns within ``JOIN_S``
("hangs") and raises nothing ("escapes"); after each example the pool's helpers are free
and asleep and a replaced pool's threads have ended ("stuck"); a forked child exits 0
within ``JOIN_S``.
"""

import os
import signal
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import ml_dtypes
import numpy as np
import torch
from fuzz_arrays import close, expected, f64, precision, snapshot
from fuzzing import COUNTS, SETTINGS, child_main, problem_values, violation
from helpers import channels_last, padded_strides
from hypothesis import given, settings
from hypothesis import strategies as st

import cudnn_bn
from cudnn_bn.backends import cpu, cpu_pool
from cudnn_bn.tensor import contiguous_strides

BF16 = np.dtype(ml_dtypes.bfloat16)
DATA_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
LAYOUTS = {"nchw": contiguous_strides, "channels_last": channels_last, "padded": padded_strides}
PASSES = ["training", "relu", "add_relu", "inference", "train", "saved", "eval", "backward_saved"]
BACKWARDS = ("train", "saved", "eval", "backward_saved")
PATHS = ["threads", "stepwise", "threads", "one_call"]  # hypothesis favours the first
ENTRIES = {  # fuzz_arrays.expected's entry of each pass
    "train": "backward", "saved": "backward", "eval": "backward", "relu": "training",
    "add_relu": "training",
}  # fmt: skip
JOIN_S = 60.0  # a call (or a forked child) that takes longer hangs
SETTLE_S = 5.0  # for the helpers to go back to sleep, and a replaced pool's to end
FORK_ONE_IN = 50
EXAMPLES_PER_RUN = 20  # a run of 100 took 25 s here: too long for the suite's few seconds
FLIPS = 200  # thread-count changes a flipping thread makes at most
THRESHOLDS = ("PARALLEL_MIN_VALUES", "THREADS_MIN_VALUES", "ITEM_MIN_VALUES", "STEPWISE_CALLS")
READS = {  # the shared inputs each pass reads
    "training": ("input", "weight", "bias"),
    "inference": ("input", "weight", "bias", "running_mean", "running_var"),
    "train": ("input", "grad_output", "weight"),
    "saved": ("input", "grad_output", "weight", "running_mean", "running_var"),
    "backward_saved": ("input", "grad_output", "weight", "saved_mean", "saved_invstd"),
}
READS |= {"relu": READS["training"], "add_relu": (*READS["training"], "z"), "eval": READS["saved"]}


@dataclass
class Problem:
    """One drawn call: its pass, shape, shared inputs by name (float64 values in ``values``),
    output mask (backward), whether it gives ``out=`` and its tolerance."""

    pass_: str
    shape: tuple[int, ...]
    args: dict
    values: dict
    mask: tuple[bool, bool, bool]
    out: bool
    tol: float


@dataclass
class Runtime:
    """How the example runs: the path drawn and the engine's thresholds for it, the thread
    count, the calling threads, the counts a flipping thread sets (none: none flips),
    whether it forks ("after" the calls, ``delay`` seconds into them: "during", or "")."""

    path: str
    thresholds: dict
    threads: int
    callers: int
    flips: tuple[int, ...]
    fork: str
    delay: float


def laid_out(values: np.ndarray, strides: tuple[int, ...], dtype, on_torch: bool):
    """``values`` as a ``dtype`` array (or tensor) of element ``strides``, gaps NaN."""
    size = 1 + sum((n - 1) * s for n, s in zip(values.shape, strides, strict=True))
    flat = np.full(size, np.nan, dtype)
    view = np.lib.stride_tricks.as_strided(flat, values.shape, [s * flat.itemsize for s in strides])
    view[...] = values
    if on_torch:
        return torch.from_numpy(flat).as_strided(values.shape, strides)
    view.flags.writeable = False
    return view


@st.composite
def problems(draw) -> Problem:
    pass_ = draw(st.sampled_from(PASSES))
    c = draw(st.sampled_from([64, 3, 13, 1, 257, 8, 2, 130, 5]))  # blocks from 4 a thread
    spatial = draw(st.sampled_from([2, 1, 0]))  # (N, C): channels innermost in any layout
    rest = draw(
        st.lists(st.sampled_from([7, 1, 16, 2, 3, 5, 9]), min_size=spatial, max_size=spatial)
    )
    n = draw(st.sampled_from([1, 2, 3, 5, 8]))
    if n * int(np.prod(rest)) < 2:  # two values per channel: a batch variance
        n = 2
    shape = (n, c, *rest)
    values = problem_values(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), shape)
    values["z"] = values["grad_output"][::-1].copy()
    dtype = draw(st.sampled_from(DATA_DTYPES))
    channel_dtype = draw(
        st.sampled_from([dtype, np.dtype(np.float32)] if dtype.itemsize == 2 else [dtype])
    )
    on_torch = dtype != BF16 and draw(st.booleans())  # torch's bf16 has no NumPy view
    layout = draw(st.sampled_from([*LAYOUTS, "mixed"]))
    args = {}
    for name, value in values.items():
        if value.ndim > 1:
            form = draw(st.sampled_from(list(LAYOUTS))) if layout == "mixed" else layout
            args[name] = laid_out(value, LAYOUTS[form](shape), dtype, on_torch)
        else:
            args[name] = laid_out(value, (1,), channel_dtype, on_torch)
    values = {name: f64(a) for name, a in args.items()}  # as the call sees them
    mask = tuple(draw(st.lists(st.booleans(), min_size=3, max_size=3)))
    if pass_ not in BACKWARDS:
        mask = (True, True, True)
    tol = max(precision(args[name]) for name in READS[pass_])
    return Problem(pass_, shape, args, values, mask, draw(st.booleans()), tol)


@st.composite
def runtimes(draw, p: Problem) -> Runtime:
    numel = int(np.prod(p.shape))
    path = draw(st.sampled_from(PATHS))
    threaded = draw(st.integers(1, numel)) if path == "threads" else numel + 1
    thresholds = {
        "PARALLEL_MIN_VALUES": min(threaded, draw(st.integers(1, numel))),
        "THREADS_MIN_VALUES": threaded,
        "ITEM_MIN_VALUES": draw(st.sampled_from([1, 64, 1024, cpu.ITEM_MIN_VALUES])),
        "STEPWISE_CALLS": draw(st.sampled_from([0, 1, 3, 1 << 30])) if path != "one_call" else 0,
    }
    threads = draw(st.sampled_from([2, 3, 1]))
    flips = (
        tuple(draw(st.lists(st.integers(1, 3), min_size=2, max_size=2)))
        if draw(st.integers(0, 3)) == 0
        else ()
    )
    fork = draw(st.sampled_from([""] * (FORK_ONE_IN - 2) + ["after", "during"]))
    fork = fork if path == "threads" else ""
    delay = draw(st.sampled_from([1e-3, 0.0, 1e-4, 5e-3]))  # of a fork "during" the calls
    return Runtime(path, thresholds, threads, draw(st.integers(1, 4)), flips, fork, delay)


def outputs(p: Problem) -> tuple | None:
    """Fresh ``out=`` arrays for one call (None: it allocates its own)."""
    if not p.out:
        return None
    x, w = p.args["input"], p.args["weight"]
    new = torch.empty_like if isinstance(x, torch.Tensor) else np.empty_like
    if p.pass_ == "inference":
        return (new(x),)
    if p.pass_ not in BACKWARDS:
        return (new(x), new(w), new(w))
    return tuple(new(a) if m else None for a, m in zip((x, w, w), p.mask, strict=True))


def call(p: Problem) -> list:
    """The drawn call, with outputs (and running statistics, where written) of its own: its
    results, then the running statistics a training forward updated."""
    a, out = p.args, outputs(p)
    x, w, b, rm, rv = (a[n] for n in ("input", "weight", "bias", "running_mean", "running_var"))
    if p.pass_ == "inference":
        outs = {} if out is None else {"out": out[0]}
        return [cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv, **outs)]
    outs = {} if out is None else {"out": out}
    if p.pass_ == "backward_saved":
        saved = {"saved_mean": a["saved_mean"], "saved_invstd": a["saved_invstd"]}
        got = cudnn_bn.batch_norm_backward(
            x, a["grad_output"], w, None, None, mode="saved", output_mask=p.mask, **saved, **outs
        )
        return list(got)
    if p.pass_ in BACKWARDS:
        got = cudnn_bn.batch_norm_backward(
            x, a["grad_output"], w, rm, rv, mode=p.pass_, output_mask=p.mask, **outs
        )
        return list(got)
    copy = torch.clone if isinstance(x, torch.Tensor) else np.copy
    rm, rv = copy(rm), copy(rv)
    if p.pass_ != "training":
        outs |= {"fusion": p.pass_, "z": a["z"] if p.pass_ == "add_relu" else None}
    return [*cudnn_bn.batch_norm_forward_training(x, w, b, rm, rv, **outs), rm, rv]


def torch_results(p: Problem) -> list:
    """torch's float64 results of ``call(p)`` (None where masked off)."""
    s = {"eps": 1e-5, "momentum": 0.1, "mode": p.pass_, "output_mask": p.mask}
    want = expected(ENTRIES.get(p.pass_, p.pass_), p.values, s, p.shape[1])
    if p.pass_ in ("relu", "add_relu"):
        z = torch.from_numpy(p.values["z"]) if p.pass_ == "add_relu" else 0
        want[0] = torch.relu(want[0] + z)
    if p.pass_ == "backward_saved":  # fuzz_arrays' entry of that name takes no mask
        want = [w if m else None for w, m in zip(want, p.mask, strict=True)]
    return want


def as_torch(p: Problem, got: list, want: list) -> None:
    """``got`` within the problem's tolerance of torch's ``want``, None where it is None."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if (g is None) != (w is None):
            raise violation("wrong", f"{p.pass_} result {i} is {g!r}, torch's {w!r}")
        if g is not None:
            close(g, w, p.tol, f"{p.pass_} {p.shape} result {i}")


def same(got: list, want: list) -> bool:
    """Bit for bit (widened to float64, which is exact), None where None."""
    return all(
        (g is None) == (w is None) and (g is None or np.array_equal(f64(g), f64(w), equal_nan=True))
        for g, w in zip(got, want, strict=True)
    )


@contextmanager
def runtime(thresholds: dict, threads: int):
    """The engine with ``thresholds`` and ``threads`` for a while, then as it was; plans made
    meanwhile are forgotten on both sides (a kernel keeps its path from its build)."""
    saved = {name: getattr(cpu, name) for name in THRESHOLDS}
    saved_threads, one_call_dtypes = cpu_pool.thread_count(), cpu._ONE_CALL_DTYPES
    cudnn_bn.descriptor_cache.clear()
    try:
        for name, value in thresholds.items():
            setattr(cpu, name, value)
        if thresholds.get("STEPWISE_CALLS"):  # no dtype's one-call pass compiled yet
            cpu._ONE_CALL_DTYPES = set()
        cpu_pool.set_thread_count(threads)
        yield
    finally:
        for name, value in saved.items():
            setattr(cpu, name, value)
        cpu._ONE_CALL_DTYPES = one_call_dtypes
        cpu_pool.set_thread_count(saved_threads)
        cudnn_bn.descriptor_cache.clear()


def in_threads(p: Problem, callers: int, flips: tuple[int, ...], meanwhile=None) -> list:
    """``call(p)`` in ``callers`` threads at once (and a thread setting the thread counts
    ``flips`` in turn meanwhile, and ``meanwhile()`` in this one): their results. A call that
    does not return within ``JOIN_S`` hangs; one that raises escapes."""
    results, errors, done = [None] * callers, [], threading.Event()
    start = threading.Barrier(callers + bool(flips))

    def caller(i: int) -> None:
        try:
            start.wait(JOIN_S)
            results[i] = call(p)
        except BaseException as exc:
            errors.append(exc)

    def flipper() -> None:
        start.wait(JOIN_S)
        for i in range(FLIPS):
            if done.is_set():
                break
            cpu_pool.set_thread_count(flips[i % 2])
            time.sleep(0)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(callers)]
    threads += [threading.Thread(target=flipper, daemon=True)] if flips else []
    for t in threads:
        t.start()
    if meanwhile is not None:
        meanwhile()
    deadline = time.monotonic() + JOIN_S
    for t in threads[:callers]:
        t.join(max(deadline - time.monotonic(), 0))
    done.set()
    if any(t.is_alive() for t in threads[:callers]):
        raise violation("hangs", f"{p.pass_} {p.shape}: a call ran past {JOIN_S} s")
    threads[-1].join(JOIN_S)
    if errors:
        raise violation("escapes", f"{p.pass_} {p.shape} raised {errors[0]!r}") from errors[0]
    return results


def walk(threads: int) -> str:
    """How the one problem in the cache runs at ``threads`` threads: "one_thread",
    "blocks" (``cpu_kernels.blocks_pass``) or "rows" (``rows_pass``); as ``cpu.launch``
    and ``on_threads`` choose."""
    (descriptor,) = cudnn_bn.descriptor_cache.descriptors()
    k = descriptor._kernel
    if not (k.parallel and threads > 1 and k.numel >= cpu.THREADS_MIN_VALUES):
        return "one_thread"
    return "blocks" if k.by_blocks(threads) else "rows"


def lone_results(p: Problem, r: Runtime, plain: list) -> dict:
    """The call alone at each thread count the example's calls may see, by count; those not
    on work items of rows must be ``plain``'s (the 1-thread one-call pass's) bit for bit."""
    found = {}
    for threads in sorted({r.threads, *r.flips}):
        cpu_pool.set_thread_count(threads)
        found[threads] = in_threads(p, 1, ())[0]
        how = walk(threads)
        COUNTS[f"walk_{how}"] += 1
        if how != "rows" and not same(found[threads], plain):
            message = f"{p.pass_} {p.shape} at {threads} threads ({how}): not 1 thread's bits"
            raise violation("wrong", message)
    cpu_pool.set_thread_count(r.threads)
    return found


def settle() -> None:
    """After an example: no caller holds the helpers, each helper is back asleep, and the
    threads of a pool a thread-count change replaced have ended."""
    pool, deadline = cpu_pool._pool, time.monotonic() + SETTLE_S
    current = set(pool.threads) if pool is not None else set()

    def settled() -> bool:
        replaced = [t for t in threading.enumerate() if t.name.startswith("cudnn_bn-cpu-")]
        if any(t not in current for t in replaced):
            return False
        return pool is None or (
            pool.owner is None and pool.job is None and pool.sleeping == pool.helpers
        )

    while not settled():
        if time.monotonic() > deadline:
            state = (pool.owner, pool.job, pool.sleeping, pool.helpers) if pool else None
            raise violation(
                "stuck",
                f"helpers not back asleep after {SETTLE_S} s: {state}, {threading.enumerate()}",
            )
        time.sleep(0.001)
    if cpu_pool._lock.locked():
        raise violation("stuck", "cpu_pool's lock is held after the calls")


def forked(p: Problem, threads: int, want: list) -> None:
    """A child forked now makes the call anew (its plan too) at ``threads`` threads; it must
    exit 0 (its results    ``want`` bit for bit) within ``JOIN_S``."""
    pid = os.fork()
    if pid == 0:
        try:
            cudnn_bn.descriptor_cache.clear()  # a plan made in the child
            cpu_pool.set_thread_count(threads)
            os._exit(0 if same(call(p), want) else 3)
        except BaseException:
            os._exit(4)
    deadline = time.monotonic() + JOIN_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise violation("hangs", f"{p.pass_} {p.shape}: a forked child ran past {JOIN_S} s")
        time.sleep(0.005)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        raise violation("crashes", f"{p.pass_} {p.shape}: a forked child died of signal {-code}")
    if code:
        raise violation("wrong", f"{p.pass_} {p.shape}: a forked child exited {code}")


def counted(p: Problem, r: Runtime) -> None:
    """What the example draws, in ``COUNTS``."""
    COUNTS["examples"] += 1
    for drawn in (f"pass_{p.pass_}", f"path_{r.path}", f"threads_{r.threads}"):
        COUNTS[drawn] += 1
    COUNTS[f"callers_{r.callers}"] += 1
    COUNTS["flips"] += bool(r.flips)
    COUNTS["out"] += p.out
    if r.fork:
        COUNTS[f"fork_{r.fork}"] += 1


@settings(SETTINGS, max_examples=EXAMPLES_PER_RUN)
@given(st.data())
def fuzz(data) -> None:
    p = data.draw(problems())
    r = data.draw(runtimes(p))
    counted(p, r)
    before = {name: snapshot(a) for name, a in p.args.items()}
    with runtime({}, 1):
        plain = in_threads(p, 1, ())[0]
    want = torch_results(p)
    as_torch(p, plain, want)
    with runtime(r.thresholds, r.threads):
        lone = lone_results(p, r, plain)
        for got in lone.values():
            as_torch(p, got, want)
        threads = max(lone)
        fork = partial(forked, p, threads, lone[threads])

        def during() -> None:  # a fork while the callers make their plans (cache cleared)
            time.sleep(r.delay)
            fork()

        if r.fork == "during":
            cudnn_bn.descriptor_cache.clear()
        for got in in_threads(p, r.callers, r.flips, during if r.fork == "during" else None):
            if not any(same(got, w) for w in lone.values()):
                message = f"{p.pass_} {p.shape}: a concurrent call's results are no lone call's"
                raise violation("wrong", message)
        settle()
        if r.fork == "after":
            fork()
    for name, a in p.args.items():
        if snapshot(a) != before[name]:
            raise violation("half_writes", f"{p.pass_} changed {name}, which it only reads")
    COUNTS["results_checked"] += 1


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # fork with threads running, torch's notes
    child_main(fuzz, settle)
