"""The fuzz tests' runner: hypothesis-driven targets in a child process, on a time budget.

A target (``fuzz_capi.py``, ``fuzz_arrays.py``, ``fuzz_distributed.py``,
``fuzz_runtime.py``) is a script with one hypothesis test whose examples count what they did
in ``COUNTS``. ``run_child`` runs it in a fresh Python process (so that a crash is reported,
not suffered) for some seconds: hypothesis runs of ``EXAMPLES_PER_RUN`` new random examples
each (fewer for a target whose examples are slow), until the time is spent; the child prints
its counts as one JSON line. An example that breaks an invariant fails: hypothesis shrinks
it and the child exits non-zero, printing the smallest example.

Budgets: ``FUZZ_SECONDS`` (environment) is the time the fuzz targets share; unset, each
target runs for its default (a few seconds, so that CI stays fast).
"""

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings

TESTS = Path(__file__).resolve().parent
# FUZZ_SECONDS is shared by all
TARGETS = ("fuzz_capi", "fuzz_arrays", "fuzz_distributed", "fuzz_runtime")
EXAMPLES_PER_RUN = 100
COUNTS: Counter = Counter()  # what the examples did: calls, statuses, refusals...
# What must never happen; the parent test asserts each count is 0.
VIOLATIONS = (
    "crashes", "escapes", "undocumented_statuses", "half_writes", "leaks", "wrong", "cuda_calls",
    "swallowed", "hangs", "stuck",
)  # fmt: skip

SETTINGS = settings(
    max_examples=EXAMPLES_PER_RUN,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def problem_values(rng: np.random.Generator, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Random float64 operands of a batch-norm problem of ``shape`` (``(N, C, ...)``): data
    off zero, weights and variances bounded away from 0, as both targets draw them."""
    c = shape[1]
    return {
        "input": rng.standard_normal(shape) * 2 + 0.5,
        "grad_output": rng.standard_normal(shape),
        "weight": rng.uniform(0.5, 1.5, c),
        "bias": rng.standard_normal(c) * 0.5,
        "running_mean": rng.standard_normal(c) * 0.3,
        "running_var": rng.uniform(0.5, 2.0, c),
        "saved_mean": rng.standard_normal(c) * 0.3,
        "saved_invstd": rng.uniform(0.5, 2.0, c),
    }


def budget(default: float) -> float:
    """Seconds for one target: its share of ``FUZZ_SECONDS``, else ``default``."""
    total = os.environ.get("FUZZ_SECONDS")
    return float(total) / len(TARGETS) if total else default


def violation(kind: str, message: str) -> AssertionError:
    """Count a broken invariant (one of ``VIOLATIONS``) and fail the example with it."""
    COUNTS[kind] += 1
    return AssertionError(f"{kind}: {message}")


def child_main(fuzz: Callable[[], None], after_run: Callable[[], None]) -> None:
    """A target's ``__main__`` (``python fuzz_x.py SECONDS``): hypothesis runs until the
    time is spent, ``after_run`` after each (its checks of what must not grow); prints
    ``FUZZ {counts}``."""
    deadline = time.monotonic() + float(sys.argv[1])
    while True:
        fuzz()
        after_run()
        COUNTS["runs"] += 1
        if time.monotonic() >= deadline:
            break
    print("FUZZ " + json.dumps(dict(COUNTS), sort_keys=True))


def run_child(target: str, seconds: float) -> dict:
    """Run ``target`` for ``seconds`` in a child: its counts, ``crashes`` 1 where it died of
    a signal. A child that failed fails the caller with its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    result = subprocess.run(
        [sys.executable, str(TESTS / f"{target}.py"), str(seconds)],
        capture_output=True,
        text=True,
        env=env,
        timeout=seconds + 300,
        check=False,
    )
    output = (result.stdout + result.stderr)[-8000:]
    if result.returncode < 0:
        return {"crashes": 1, "signal": -result.returncode, "output": output}
    assert result.returncode == 0, f"{target} failed:\n{output}"
    line = [x for x in result.stdout.splitlines() if x.startswith("FUZZ ")][-1]
    return json.loads(line[len("FUZZ ") :])
