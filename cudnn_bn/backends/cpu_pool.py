"""The CPU engine's threads: a small pool of the package's own Python threads.

The kernels (``cpu_kernels``) release the GIL, so work items handed to plain threads run
truly in parallel; numba's parallel layer (OpenMP, TBB, workqueue) is never started, so
none of its limits apply: a child forked after a parallel call gets a fresh pool (the
parent's threads do not exist in it), and any number of calling threads may share the
pool. The calling thread works too: it takes items like the pool's threads do, and stops
waiting for a helper that has not started (that helper would find no items left).
"""

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba


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


def run(task: Callable[[int], None], items: int) -> None:
    """``task(i)`` for every ``i`` in ``range(items)``, on up to ``thread_count()``
    threads; returns when all are done (the first exception raised, raised here)."""
    helpers = min(items, _count) - 1
    remaining = iter(range(items))  # shared: each next() hands out one item (under the GIL)

    def drain() -> None:
        for item in remaining:
            task(item)

    if helpers <= 0:
        drain()
        return
    pool = _helpers(_count - 1)
    started = [pool.submit(drain) for _ in range(helpers)]
    try:
        drain()
    finally:  # no helper may still write into the caller's memory after we return
        for helper in started:
            if not helper.cancel():
                helper.exception()
    for helper in started:
        if not helper.cancelled() and helper.exception() is not None:
            raise helper.exception()
