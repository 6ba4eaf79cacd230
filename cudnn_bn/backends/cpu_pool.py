"""The CPU engine's threads: a small pool of the package's own Python threads.

The kernels (``cpu_kernels``) release the GIL, so work items handed to plain threads run
truly in parallel; numba's parallel layer (OpenMP, TBB, workqueue) is never started, so
none of its limits apply: a child forked after a parallel call gets a fresh pool (the
parent's threads do not exist in it), and any number of calling threads may share the
pool. The calling thread works too: every thread of a step runs the same kernel, which
claims work items one at a time (an atomic counter) until none is left, then waits a
little (without the GIL) until all are done; the caller returns once every item is done,
without waiting for a helper that holds none (``team``).
"""

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np


def _configured_count() -> int:
    """``NUMBA_NUM_THREADS`` (numba's default: the CPUs this process may use), capped by
    ``OMP_NUM_THREADS`` where that is set."""
    count = numba.config.NUMBA_NUM_THREADS
    try:
        return max(1, min(count, int(os.environ["OMP_NUM_THREADS"].split(",")[0])))
    except (KeyError, ValueError):
        return count


_count = _configured_count()
_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (helpers, pool), on first use


def thread_count() -> int:
    """Threads a large call uses (the caller's included)."""
    return _count


def set_thread_count(count: int) -> None:
    """Use ``count`` threads per large call from now on (at least 1)."""
    global _count
    _count = max(1, int(count))


def _helpers(count: int) -> ThreadPoolExecutor:
    """The pool of ``count`` helper threads (a new one when the thread count changed)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != count:
            _pool = (count, ThreadPoolExecutor(count, thread_name_prefix="cudnn_bn-cpu"))
        return _pool[1]


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads are gone; the next call starts anew."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def team(task: Callable[[], None], items: int, state: np.ndarray) -> None:
    """``task()`` on the calling thread and at once on up to ``thread_count() - 1`` helpers
    (no more threads than ``items``), for a task that claims its work items itself and
    counts those done in ``state[1]`` (``cpu_kernels``' item kernels). The caller waits for
    a helper only if an item is still in progress when its own task returns: a helper that
    starts late finds nothing left. (Waking the caller when a helper finishes, and handing
    each item out under the GIL, cost 0.1-0.4 ms a step on a busy 2-core machine: the
    caller's return waited on the GIL while a helper took every other item.)"""
    helpers = min(items, _count) - 1
    started = [_helpers(_count - 1).submit(task) for _ in range(helpers)]
    try:
        task()
    finally:  # no helper may still write into the caller's memory after we return
        for helper in started:
            if not helper.cancel() and state[1] < items:
                helper.exception()
