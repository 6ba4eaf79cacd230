"""``infiniopSet...Attributes`` on a descriptor while other threads compute with it (issue 16,
finding 2): a compute runs one consistent build (kernel, attributes and the pointers they
need, read once), and a rebuild never closes a kernel a running compute holds.

Runs in a child process: the bug this guards against was a SIGSEGV (an eval-mode kernel run
with the train mode's list of needed pointers, so NULL running statistics reached it).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import ctypes, sys, threading, time
    import numpy as np
    sys.path.insert(0, "tests")
    from helpers import ok, reference, tensor_desc
    from cudnn_bn import Status, capi

    sys.setswitchinterval(1e-6)  # switch threads often: races show within seconds
    toggle = sys.argv[1] == "toggle"
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    w, stats = rng.random(3) + 0.5, rng.random(3) + 0.5
    want = [t.numpy() for t in reference(x, dy, w)]
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    descs = [tensor_desc(a) for a in (x, w, w, x, dy, w, stats, stats)]
    ok(capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(op), *descs))
    end = time.monotonic() + float(sys.argv[2])
    bad, calls = [], 0

    def compute() -> None:
        outs = [np.empty_like(a) for a in want]
        ptrs = [a.ctypes.data for a in (*outs, x, dy, w)]
        global calls
        while time.monotonic() < end:
            calls += 1
            status = capi.infiniopBatchNormBackward(op, None, 0, *ptrs, 0, 0, None)
            if status == Status.SUCCESS:  # train mode: running statistics not read
                if not all(np.allclose(o, e, atol=1e-12) for o, e in zip(outs, want)):
                    bad.append("a wrong result")
            elif not (toggle and status == Status.NULL_POINTER):
                bad.append(f"status {status}: {capi.last_error()}")

    def set_attributes() -> None:
        modes = (0, 2) if toggle else (0,)
        while time.monotonic() < end:
            for mode in modes:
                ok(capi.infiniopSetBatchNormBackwardAttributes(op, 1e-5, mode))

    threads = [threading.Thread(target=f) for f in (compute, compute, set_attributes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok(capi.infiniopDestroyBatchNormBackwardDescriptor(op))
    print(len(bad), "bad of", calls, sorted(set(bad))[:3])
    sys.exit(1 if bad else 0)
    """
)


def run_child(how: str, seconds: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, how, str(seconds)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_attribute_changes_never_crash_a_concurrent_compute():
    """Toggling train/eval while computing with NULL running statistics: each compute is
    SUCCESS (train) or NULL_POINTER (eval), never a crash or a wrong status."""
    done = run_child("toggle", 3.0)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])


def test_unchanged_attributes_never_fail_a_concurrent_compute():
    """Setting the same attributes again and again: every compute succeeds (no spurious
    "used after destroy()")."""
    done = run_child("same", 3.0)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
