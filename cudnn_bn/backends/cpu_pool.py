"""The CPU engine's threads: a small pool of the package's own Python threads.

The kernels (``cpu_kernels``) release the GIL, so work items handed to plain threads run
truly in parallel; numba's parallel layer (OpenMP, TBB, workqueue) is never started, so
none of its limits apply: a child forked after a parallel call gets a fresh pool (the
parent's threads do not exist in it), and any number of calling threads may share the
pool (one caller at a time has its helpers; another runs its steps alone). The calling
thread works too: every thread of a step runs the same kernel, which claims work items
one at a time (an atomic counter) until none is left, then waits a little (without the
GIL) until all are done; the caller returns once every item is done, without waiting for
a helper that holds none (``team``).

Between steps and calls a helper spins on a word (compiled, without the GIL) for about
``SPINS`` reads, then sleeps on a condition, so that an idle process burns no CPU: a pass's
steps, and calls back to back, find it awake. Handing each step to a sleeping helper (an
executor's queue) cost a futex wake per step: 40-130 us here after 0.1-20 ms idle, and
20-80 us for the caller to submit it. A large call wakes a sleeping helper as it begins
(``wake``), so that the wake-up overlaps the call's own set-up.
"""

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numba
import numpy as np
from llvmlite.binding import ffi
from numba.core.compiler_lock import global_compiler_lock

from ..enums import Status
from ..errors import InfiniError, integer, shown
from .cpu_kernels import _atomic_read, jit

SPINS = 1 << 18  # reads of a word before a waiting thread sleeps: about 0.15 ms here


def _configured_count() -> int:
    """``NUMBA_NUM_THREADS`` (numba's default: the CPUs this process may use), capped by
    ``OMP_NUM_THREADS`` where that is set."""
    count = numba.config.NUMBA_NUM_THREADS
    try:
        return max(1, min(count, int(os.environ["OMP_NUM_THREADS"].split(",")[0])))
    except (KeyError, ValueError):
        return count


@jit
def _await(word, index, target, spins):
    """Whether ``word[index]`` reaches ``target`` within ``spins`` reads (GIL released)."""
    reads = 0
    while reads < spins and _atomic_read(word, index) < target:
        reads += 1
    return reads < spins


class _Job:
    """One step's task as handed to the helpers, and what became of it."""

    __slots__ = ("closed", "error", "finished", "returned", "taken", "task")

    def __init__(self, task: Callable[[], None]) -> None:
        self.task, self.taken, self.finished = task, 0, 0
        self.closed = self.returned = False  # no helper may take it; the caller has returned
        self.error: BaseException | None = None  # a helper's, for the caller to raise


class _Pool:
    """``helpers`` daemon threads running the jobs one caller at a time posts (``team``)."""

    def __init__(self, helpers: int) -> None:
        self.helpers = helpers
        self.word = np.zeros(1, np.int64)  # the number of the latest job (or stop)
        # Guards the job and the counts below; reentrant: a signal handler may make a call
        # (and post its job) in a thread that holds it, waking the helpers for another call.
        self.lock = threading.RLock()
        self.posted = threading.Condition(self.lock)  # sleeping helpers wait here
        self.finished = threading.Condition(self.lock)  # a caller waits here for helpers
        self.job: _Job | None = None
        self.owner: _Job | None = None  # the job of the caller that has the helpers
        self.sleeping, self.running = 0, True
        self.threads: list[threading.Thread] = []
        try:
            for i in range(helpers):
                thread = threading.Thread(target=self.serve, name=f"cudnn_bn-cpu-{i}", daemon=True)
                thread.start()
                self.threads.append(thread)
        except BaseException as exc:  # a signal handler's, or "can't start new thread"
            self.stop()  # the helpers that started end
            if not isinstance(exc, RuntimeError):
                raise
            raise InfiniError(
                Status.INTERNAL_ERROR,
                f"the CPU engine started {len(self.threads)} of its {helpers} helper threads "
                f"({exc}); ask for fewer with cudnn_bn.backends.cpu_pool.set_thread_count",
            ) from None

    def wake(self) -> None:
        """Make sleeping helpers spin again (they sleep after ``SPINS`` reads)."""
        if self.sleeping:
            with self.lock:
                self.posted.notify_all()

    def stop(self) -> None:
        """Let the helpers end (after the job they run, if any)."""
        with self.lock:
            self.running = False
            self.word[0] += 1
            self.posted.notify_all()

    def serve(self) -> None:
        """A helper: spin, then sleep, until a job is posted; run it; again."""
        seen = 0
        while True:
            if not _await(self.word, 0, seen + 1, SPINS):
                with self.lock:
                    if self.word[0] == seen and self.running:
                        self.sleeping += 1
                        self.posted.wait()  # a job, or ``wake``
                        self.sleeping -= 1
                continue
            with self.lock:
                if not self.running:
                    return
                seen, job = int(self.word[0]), self.job
                if job is None or job.closed:
                    continue
                job.taken += 1
            self.run(job)
            del job  # its task holds the caller's arrays: keep none alive between calls

    def run(self, job: _Job) -> None:
        """Run ``job``'s task on this helper; its exception goes to the caller, or to
        ``threading.excepthook`` once the caller has returned."""
        error = None
        try:
            job.task()
        except BaseException as failure:
            error = failure
        with self.lock:
            job.finished += 1
            if error is not None and not job.returned:
                job.error, error = job.error or error, None
            self.finished.notify_all()
        if error is not None:
            report = (type(error), error, error.__traceback__, threading.current_thread())
            threading.excepthook(threading.ExceptHookArgs(report))

    def post(self, job: _Job) -> bool:
        """Hand ``job`` to the helpers, unless another caller's has them (False). Its caller
        gives them back by clearing ``owner``: one store, where no signal handler runs."""
        with self.lock:
            if self.owner is not None:
                return False
            self.owner = self.job = job
            self.word[0] += 1
            if self.sleeping:
                self.posted.notify_all()
        return True

    def close(self, job: _Job, state: np.ndarray, items: int) -> None:
        """Take ``job`` back from the helpers once no helper can write for it any more:
        every item done (``state[1]``; the caller's task has returned, so every item was
        claimed). A helper's exception is raised here."""
        with self.lock:
            job.closed, self.job = True, None
        if not _await(state, 1, items, SPINS):
            with _signals_deferred(), self.lock:
                while job.error is None and state[1] < items:
                    self.finished.wait()
        with self.lock:
            job.returned, error = True, job.error
        if error is not None:
            raise error

    def abandon(self, job: _Job) -> None:
        """After the call raised (its task, a helper, or a signal handler while it posted
        or waited): no helper takes ``job`` any more, and the caller waits for every helper
        that took it, so that nothing writes the call's arrays once it has raised. An
        exception raised meanwhile (another signal's) gives way to the call's own."""
        while True:
            try:
                with self.lock:
                    job.closed = True
                    if self.job is job:
                        self.job = None
                    while job.finished < job.taken:
                        self.finished.wait()
                    job.returned = True
                return
            except BaseException:  # another signal: the call's own exception is raised after
                continue


# Signals a fault raises in the thread it hits: never held back.
_SYNCHRONOUS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT}


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Signals held back from the main thread (where Python runs their handlers) while it
    waits for a helper, and handled right after: a handler that raised while
    ``Condition.wait`` took its lock back left the lock unheld (CPython's behaviour), and
    the ``with`` block's exit then failed (RuntimeError, "cannot release un-acquired lock")
    in place of the handler's exception."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    # The mask to restore is kept before any signal is blocked: a signal pending until then
    # has its handler run as the blocking call returns, and its exception must unblock too.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _SYNCHRONOUS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


_count = _configured_count()
# The most set_thread_count takes (each is a Python thread).
MOST_THREADS = max(1024, numba.config.NUMBA_NUM_THREADS)
_lock = threading.Lock()
_pool: _Pool | None = None  # on first use


def thread_count() -> int:
    """Threads a large call uses (the caller's included)."""
    return _count


def set_thread_count(count: int) -> None:
    """Use ``count`` threads per large call from now on: an integer (1 where it is less),
    at most ``MOST_THREADS``; BAD_PARAM naming ``count`` for anything else."""
    global _count
    number = integer("count", count)
    if number is None:
        raise InfiniError(Status.BAD_PARAM, f"count must be an integer, got {shown(count)}")
    if number > MOST_THREADS:
        raise InfiniError(
            Status.BAD_PARAM, f"count is {shown(number)}; at most {MOST_THREADS} threads"
        )
    _count = max(1, number)


def _helpers(count: int) -> _Pool | None:
    """The pool of ``count`` helper threads (a new one when the thread count changed); None
    while another call makes it, or this thread does in a call a signal handler interrupted:
    that call runs alone rather than wait (for itself)."""
    global _pool
    if _lock.locked():  # not ``acquire(blocking=False)``: a handler's exception as it
        return None  # returned, before a ``try``, left the lock held for good
    with _lock:  # another thread's call may have it now: a moment, while it makes the pool
        if _pool is None or _pool.helpers != count:
            if _pool is not None:
                _pool.stop()
                _pool = None
            _pool = _Pool(count)
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads are gone; the next call starts anew."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
# A fork waits for a compile in another thread to end, and for an LLVM call (llvmlite's lock,
# which a new plan's look-up of its steps' addresses takes without numba's compiler lock): a
# child forked while another thread held either lock would wait for it forever at its own
# first compile or plan. Taken in the order a compile takes them.
_FORK_LOCKS = (global_compiler_lock, ffi.lib._lock._lock)


def _hold_fork_locks() -> None:
    for lock in _FORK_LOCKS:
        lock.acquire()


def _release_fork_locks() -> None:
    for lock in reversed(_FORK_LOCKS):
        lock.release()


os.register_at_fork(
    before=_hold_fork_locks, after_in_parent=_release_fork_locks, after_in_child=_release_fork_locks
)


def wake() -> None:
    """Wake the helpers now, ahead of a large call's first ``team``: waking a sleeping
    thread takes tens to hundreds of microseconds, which then overlap the caller's work."""
    pool = _helpers(_count - 1) if _count > 1 else None
    if pool is not None:
        pool.wake()


def team(task: Callable[[], None], items: int, state: np.ndarray) -> None:
    """``task()`` on the calling thread and at once on the helpers (unless another caller
    has them), for a task that claims its work items itself and counts those done in
    ``state[1]`` (``cpu_kernels``' item kernels). The caller waits for a helper only if an
    item is still in progress when its own task returns: a helper that starts late finds
    nothing left. (Waking the caller when a helper finishes, and handing each item out
    under the GIL, cost 0.1-0.4 ms a step on a busy 2-core machine: the caller's return
    waited on the GIL while a helper took every other item.) A helper's exception is
    raised here."""
    if min(items, _count) < 2:
        task()
        return
    pool = _helpers(_count - 1)
    if pool is None:
        task()
        return
    job = _Job(task)
    try:  # taken in it (``post``), so that a handler's exception gives the helpers back
        if not pool.post(job):
            task()  # another caller has the helpers
            return
        task()
        pool.close(job, state, items)
    except BaseException:
        pool.abandon(job)
        raise
    finally:
        if pool.owner is job:
            pool.owner = None
