"""How a large CPU call shares its work among the engine's threads (cudnn_bn/backends/
cpu_pool.py, the item kernels of cpu_kernels.py), checked against torch in float64:

- the caller never waits for a helper thread that took no item (one that starts late, or
  waits for a CPU, held the call up by up to milliseconds on a busy 2-core machine);
- a large call is split in more items than threads, so a thread that starts late or runs
  slowly does less of the work.
"""

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import cudnn_bn
from cudnn_bn.backends import cpu, cpu_layout, cpu_pool
from cudnn_bn.enums import DataType
from cudnn_bn.problems import ForwardInferenceAttributes, ForwardInferenceTensors
from cudnn_bn.tensor import TensorDesc

LATE_S = 0.3  # how late the stand-in helper starts (a thread waiting for a CPU)


class LateHelpers(cpu_pool._Pool):
    """A pool whose helper takes each job up at once and runs it ``LATE_S`` later."""

    def __init__(self) -> None:
        super().__init__(1)
        self.started = threading.Event()

    def post(self, job):
        task = job.task

        def late():
            self.started.set()
            time.sleep(LATE_S)
            task()

        job.task = late
        super().post(job)
        assert self.started.wait(LATE_S)  # taken up: the caller cannot take it back


@pytest.fixture
def two_threads(monkeypatch):
    """Two threads, from 65536 values on (``cpu.THREADS_MIN_VALUES``: 2 Mi)."""
    monkeypatch.setattr(cpu, "THREADS_MIN_VALUES", cpu.PARALLEL_MIN_VALUES)
    previous = cpu_pool.thread_count()
    cpu_pool.set_thread_count(2)
    yield
    cpu_pool.set_thread_count(previous)


def torch_inference(x, w, b, rm, rv) -> np.ndarray:
    t = [torch.from_numpy(np.asarray(a, np.float64)) for a in (x, rm, rv, w, b)]
    return torch.nn.functional.batch_norm(*t, training=False, eps=1e-5).numpy()


def test_caller_does_not_wait_for_a_helper_that_took_no_item(two_threads, monkeypatch):
    """A helper that has taken up its task but not yet run it (it waits for a CPU) finds
    no item left once the caller has done them all: the call returns without it."""
    late = LateHelpers()
    monkeypatch.setattr(cpu_pool, "_helpers", lambda count: late)
    rng = np.random.default_rng(0)
    nhwc = rng.standard_normal((16, 32, 32, 64)).astype(np.float32)
    x = nhwc.transpose(0, 3, 1, 2)  # channels-last
    w, b = rng.uniform(0.5, 1.5, 64), rng.uniform(-1, 1, 64)
    rm, rv = rng.uniform(-1, 1, 64), rng.uniform(0.5, 2, 64)
    w, b, rm, rv = (a.astype(np.float32) for a in (w, b, rm, rv))
    cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)  # compiled, and the helper busy
    time.sleep(LATE_S)
    late.started.clear()
    start = time.perf_counter()
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)
    took = time.perf_counter() - start
    np.testing.assert_allclose(y, torch_inference(x, w, b, rm, rv), rtol=1e-6, atol=1e-6)
    assert took < LATE_S / 2, took
    late.stop()


def test_large_calls_are_split_in_more_items_than_threads(two_threads, monkeypatch):
    """A channels-last call of 1M values on two threads is eight work items of rows,
    handed out one at a time (a channel-outer one: blocks of channels)."""
    seen = []
    items = cpu_layout.Layout.items
    monkeypatch.setattr(
        cpu_layout.Layout, "items", lambda layout, count: seen.append(count) or items(layout, count)
    )
    rng = np.random.default_rng(1)
    x = np.moveaxis(rng.standard_normal((16, 32, 32, 64)).astype(np.float32), -1, 1)
    w, b = np.ones(64, np.float32), np.zeros(64, np.float32)
    y, *_ = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    want = torch.nn.functional.batch_norm(
        torch.from_numpy(x.astype(np.float64)), None, None, training=True, eps=1e-5
    ).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert seen[-1] == 8  # (the first: the descriptor's whole-tensor item)


def test_work_items_are_made_once_per_count():
    """A large call's item table is the layout's, made on its first call only (building it
    cost about 20 us of every call after the machine idled)."""
    x = TensorDesc(DataType.F32, (16, 64, 32, 32), (65536, 1, 2048, 64))
    channel = TensorDesc(DataType.F32, (64,), (1,))
    kernel = cpu.BatchNormForwardInference(
        ForwardInferenceTensors(x, x, channel, channel, channel, channel),
        ForwardInferenceAttributes(eps=1e-5),
    )
    items = kernel.work_items(8)
    np.testing.assert_array_equal(items, kernel.layout.items(8))
    assert kernel.work_items(8) is items


def test_a_helpers_exception_is_raised_by_the_caller(two_threads):
    """A helper that fails holding a work item leaves the step incomplete: ``team`` raises
    its exception rather than returning as if every item were done."""
    items, state, claims = 2, np.zeros(2, np.int64), threading.Lock()
    helper_holds_one = threading.Event()

    def claim() -> int:
        with claims:
            state[0] += 1
            return int(state[0]) - 1

    def task() -> None:
        if threading.current_thread() is not threading.main_thread():
            if claim() < items:
                helper_holds_one.set()
                raise ValueError("the helper failed")
            return
        assert helper_holds_one.wait(10)
        while claim() < items:
            state[1] += 1

    with pytest.raises(ValueError, match="the helper failed"):
        cpu_pool.team(task, items, state)
    assert state[1] == 1


def cpu_ticks(thread: threading.Thread) -> int:
    """User and system clock ticks ``thread`` has run (Linux)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_helpers_sleep_while_the_process_idles(two_threads):
    """Helpers spin between steps and calls (``SPINS``: about 0.15 ms), then sleep: an idle process
    burns no CPU on them."""
    x = np.random.default_rng(2).standard_normal((16, 64, 32, 32)).astype(np.float32)
    w, b = np.ones(64, np.float32), np.zeros(64, np.float32)
    cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    helpers = cpu_pool._helpers(1).threads
    time.sleep(0.05)
    before = [cpu_ticks(t) for t in helpers]
    time.sleep(0.3)
    assert [cpu_ticks(t) - b for t, b in zip(helpers, before, strict=True)] == [0] * len(helpers)


@pytest.mark.parametrize(
    "shape, layout, want_teams",
    [
        ((16, 64, 32, 32), "nchw", []),  # 1 Mi values: under cpu.THREADS_MIN_VALUES
        ((32, 64, 32, 32), "nchw", [32]),  # blocks of channels (of BLOCK_BYTES), one hand-off
        ((16, 64, 32, 32), "nhwc", []),
        ((32, 64, 32, 32), "nhwc", [8]),  # work items of rows, one hand-off
    ],
    ids=str,
)
def test_which_calls_reach_the_helpers(shape, layout, want_teams, monkeypatch):
    """A pass hands work to the helpers where a second thread saves more than its hand-off
    costs, from ``cpu.THREADS_MIN_VALUES`` on, in one hand-off: blocks of channels where
    runs stay in one channel, work items of rows where channels are innermost; below, the
    calling thread does it all."""
    teams = []  # the items of each team that may reach a helper (a problem's first calls,
    # ``cpu.STEPWISE_CALLS``, make teams of one item, which run on the calling thread)
    team = cpu_pool.team
    monkeypatch.setattr(
        cpu_pool, "team", lambda *args: (args[1] > 1 and teams.append(args[1])) or team(*args)
    )
    monkeypatch.setattr(cpu_pool, "_count", 2)
    rng = np.random.default_rng(3)
    n, c = shape[:2]
    x = rng.standard_normal((n, 32, 32, c) if layout == "nhwc" else shape).astype(np.float32)
    x = np.moveaxis(x, -1, 1) if layout == "nhwc" else x
    w, b = np.ones(c, np.float32), np.zeros(c, np.float32)
    y, *_ = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    assert teams == want_teams
    want = torch.nn.functional.batch_norm(
        torch.from_numpy(x.astype(np.float64)), None, None, training=True, eps=1e-5
    ).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_the_pool_keeps_no_task_alive_after_a_call(two_threads):
    """A step's task holds the call's arrays: neither the pool nor a helper keeps it once
    ``team`` returns."""
    items, state = 2, np.zeros(2, np.int64)
    taken = threading.Event()

    def task() -> None:
        if threading.current_thread() is not threading.main_thread():
            taken.set()
            return
        assert taken.wait(10)  # the helper has run it (and returned, holding no item)
        state[0] = state[1] = items

    cpu_pool.team(task, items, state)
    gone = weakref.ref(task)
    del task
    time.sleep(0.01)  # the helper back to waiting
    gc.collect()
    assert gone() is None


SIGNALLED_CALLS = """
import signal, sys, time
import numpy as np, cudnn_bn
from cudnn_bn.backends import cpu_pool

cpu_pool.set_thread_count(2)
rng = np.random.default_rng(4)
x = rng.standard_normal((80, 64, 32, 32), dtype=np.float32)  # 5.2M values: threaded
w, b = rng.uniform(0.5, 1.5, 64).astype(np.float32), np.zeros(64, np.float32)
rm, rv = np.zeros(64, np.float32), np.ones(64, np.float32)
want = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)
inner = np.empty_like(x)
signal.signal(signal.SIGALRM, lambda *_: cudnn_bn.batch_norm_forward_inference(
    x, w, b, rm, rv, out=inner))
for n in range(300):  # the signal at 10-2000 us into a call, the helpers spinning or asleep
    signal.setitimer(signal.ITIMER_REAL, 1e-5 + 5e-5 * (n % 41))
    y = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)
    assert np.array_equal(y, want)
    time.sleep(3e-4 * (n % 7))
signal.setitimer(signal.ITIMER_REAL, 0)
print(np.array_equal(inner, want))
"""


def test_a_call_from_a_signal_handler_during_a_threaded_call():
    """A signal handler that makes a large call, run while the interrupted call holds the
    pool's lock (waking its helpers, posting a job, waiting for one): the handler's call
    waited for that lock, which its own thread held, for ever (found by an outsider's
    attack; it hung within a second). It now runs alone, and both calls are right."""
    child = subprocess.run(
        [sys.executable, "-c", SIGNALLED_CALLS], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["True"], child.stdout


def team_with_a_slow_helper(monkeypatch, wait, written: list[int]):
    """``cpu_pool.team`` of two items where the helper's takes 0.2 s (then appended to
    ``written``), so that the caller, done with its own, waits for it through
    ``wait(real_wait, timeout)`` (the pool's ``finished.wait`` wrapped); what it raised."""
    pool = cpu_pool._helpers(1)

    class Waiting(threading.Condition):
        def wait(self, timeout=None):
            return wait(super().wait, timeout)

    monkeypatch.setattr(pool, "finished", Waiting(pool.lock))
    items, state = 2, np.zeros(2, np.int64)
    claims, helper_has_one = threading.Lock(), threading.Event()

    def task() -> None:
        helper = threading.current_thread() is not threading.main_thread()
        if not helper:
            assert helper_has_one.wait(10)
        while True:
            with claims:
                mine, state[0] = int(state[0]), state[0] + 1
            if mine >= items:
                return
            if helper:
                helper_has_one.set()
                time.sleep(0.2)
                written.append(mine)
            with claims:
                state[1] += 1

    try:
        cpu_pool.team(task, items, state)
    except KeyboardInterrupt as raised:
        return raised
    return None


def test_a_call_interrupted_while_it_waits_for_a_helper_raises_after_it(two_threads, monkeypatch):
    """A signal handler's exception while the caller waits for a helper's item (raised
    here by the wait itself, once) is raised once the helper is done: it was raised at
    once, and the helper went on writing the call's arrays (found by an outsider's attack,
    in 7 of 262 calls a timer's signal ended)."""
    interrupted, written = [], []

    def interrupting(wait, timeout):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return wait(timeout)

    raised = team_with_a_slow_helper(monkeypatch, interrupting, written)
    assert isinstance(raised, KeyboardInterrupt) and written == [0]


def test_a_signal_while_the_caller_waits_for_a_helper_is_handled_after_the_wait(
    two_threads, monkeypatch
):
    """A signal arriving while the caller waits for a helper is handled once the wait is
    over (the helper done): inside it, a handler's exception while ``Condition.wait`` took
    the pool's lock back left the lock unheld, and the call raised RuntimeError "cannot
    release un-acquired lock" (as INTERNAL_ERROR) in its place (found by an outsider's
    attack)."""
    written, seen = [], []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append(len(written)))

    def signalled(wait, timeout):
        signal.raise_signal(signal.SIGUSR1)
        return wait(timeout)

    try:
        raised = team_with_a_slow_helper(monkeypatch, signalled, written)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert raised is None and written == [0] and seen == [1]


def test_a_handlers_exception_as_signals_are_held_back_leaves_none_held(two_threads, monkeypatch):
    """A signal that arrived just before the caller's wait held signals back has its handler
    run as the blocking ``pthread_sigmask`` returns (CPython runs handlers after a call): its
    exception left every signal blocked in the main thread for good (and in the threads and
    programs it starts later), since the mask to restore was not yet kept. Simulated by
    raising as that call returns."""
    real = signal.pthread_sigmask
    before = real(signal.SIG_BLOCK, ())

    def handled_on_return(how, mask):
        previous = real(how, mask)
        if how == signal.SIG_BLOCK and mask:
            raise KeyboardInterrupt  # the handler of a signal pending before the block
        return previous

    monkeypatch.setattr(signal, "pthread_sigmask", handled_on_return)
    try:
        raised = team_with_a_slow_helper(monkeypatch, lambda wait, timeout: wait(timeout), [])
    finally:
        left = real(signal.SIG_SETMASK, before)  # this process's mask back, whatever happened
    assert isinstance(raised, KeyboardInterrupt) and left == before


def helper_runs_a_task() -> bool:
    """Whether ``cpu_pool.team`` hands a task of two items to a helper (within 5 s)."""
    items, state, ran = 2, np.zeros(2, np.int64), threading.Event()

    def task() -> None:
        if threading.current_thread() is not threading.main_thread():
            ran.set()
            return
        ran.wait(5)
        state[0] = state[1] = items

    cpu_pool.team(task, items, state)
    return ran.is_set()


def helpers_alive(timeout: float = 2.0) -> int:
    """The engine's helper threads alive once those told to end have (within ``timeout``)."""
    want, deadline = cpu_pool._pool.helpers, time.monotonic() + timeout
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith("cudnn_bn-cpu-")]
        if len(alive) <= want or time.monotonic() > deadline:
            return len(alive)
        time.sleep(0.01)


@pytest.mark.parametrize("new_pool", [False, True], ids=["same pool", "new pool"])
def test_a_handlers_exception_anywhere_in_a_hand_off_leaves_the_helpers_free(two_threads, new_pool):
    """A signal handler's exception wherever Python runs handlers in ``team`` (and the pool's
    code it calls, making a new pool of helpers where the thread count changed) leaves the
    helpers to the next call, and no helper running that no pool holds: one raised as
    ``team``'s taking of the helpers (or of the lock for making them) returned, before its
    ``try``, left them taken for good, and every later call ran alone (found by an outsider's
    attack: after 52 calls a 1.1 ms timer's signal ended); one raised as a new pool started
    its threads left those started running. Raised here by a profile function at each point
    in turn where CPython runs pending handlers: as a Python function starts and as a call
    to a C function returns."""
    pool_code = cpu_pool.__file__

    def points_run(stop_at: int) -> int:
        seen = 0

        def profile(frame, event, arg):
            nonlocal seen
            if frame.f_code.co_filename == pool_code and event in ("call", "c_return"):
                seen += 1
                if seen == stop_at:
                    raise KeyboardInterrupt

        if new_pool:
            cpu_pool.set_thread_count(5 - cpu_pool.thread_count())  # 2, 3, 2...
        sys.setprofile(profile)
        try:
            assert helper_runs_a_task()
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        return seen

    assert helper_runs_a_task()
    for stop_at in range(1, points_run(0) + 1):
        points_run(stop_at)
        assert helper_runs_a_task(), f"no helper after an exception at point {stop_at}"
        assert helpers_alive() == cpu_pool.thread_count() - 1, f"at point {stop_at}"


class _FloatIndex:
    """An ``__index__`` that returns a float (Python's TypeError: a raw error before)."""

    def __index__(self):
        return 2.0


@pytest.mark.parametrize(
    "count", ["a", None, 2.5, True, float("nan"), float("inf"), 10**30, 1 << 20, _FloatIndex()]
)
def test_a_thread_count_that_is_none_is_bad_param_naming_it(count):
    """``set_thread_count`` (a public name of the README) takes an integer (torch's and
    numba's take no float either) of at most ``MOST_THREADS``: 'a', None, nan or inf raised
    ValueError/TypeError/OverflowError, 2.5 and True were taken as 2 and 1, and 10**30 was
    taken, after which a large call made Thread objects until memory ran out (found by an
    outsider's attack). Numbers below 1 are still 1."""
    previous = cpu_pool.thread_count()
    try:
        with pytest.raises(cudnn_bn.InfiniError, match="count") as caught:
            cpu_pool.set_thread_count(count)
        assert caught.value.status == cudnn_bn.Status.BAD_PARAM
        assert cpu_pool.thread_count() == previous
        cpu_pool.set_thread_count(np.int64(-3))
        assert cpu_pool.thread_count() == 1
    finally:
        cpu_pool.set_thread_count(previous)


_NO_THREADS_SCRIPT = """
import threading
import numpy as np
import cudnn_bn
from cudnn_bn.backends import cpu_pool

started = []


class Refused(threading.Thread):  # the system starts 2 of the helpers, then refuses
    def start(self):
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        started.append(self)
        super().start()


cpu_pool.threading.Thread = Refused
cpu_pool.set_thread_count(8)
x = np.ones((20, 16, 128, 128), np.float32)  # threaded: 5.2 million values
try:
    cudnn_bn.batch_norm_backward(x, x, np.ones(16, np.float32), None, None)
except cudnn_bn.InfiniError as exc:
    print(exc.status.name, exc)
for thread in started:
    thread.join(timeout=10)
print("running", sum(t.is_alive() for t in started))
"""


def test_helpers_that_cannot_all_start_leave_none_running():
    """A pool whose helpers the system will not all start (a container's thread limit, a
    large thread count): the call raises an InfiniError saying so, and the helpers that did
    start end. They were left spinning and sleeping for good, and the error was 'unexpected
    RuntimeError' (found by an outsider's attack)."""
    child = subprocess.run(
        [sys.executable, "-c", _NO_THREADS_SCRIPT], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    first, last = lines[0], lines[-1]
    assert first.startswith("INTERNAL_ERROR") and "set_thread_count" in first, first
    assert last == "running 0", child.stdout
