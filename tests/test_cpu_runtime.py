"""Where the CPU engine runs (issue 18), each case in a child process with a time limit:

- in a child forked after a parallel call (``os.fork``, and ``multiprocessing.Pool`` with the
  fork start method): GNU OpenMP killed or hung such children; and in one forked while
  another thread compiles, or makes an LLVM call;
- under every numba threading layer installed, from 16 Python threads at once: numba's
  ``workqueue`` layer aborted the process ("Concurrent access has been detected");
- where no cache location is writable: every call failed with INTERNAL_ERROR ("no locator
  available"); now the kernels compile in memory, with one warning;
- a small call does not start numba's thread pool (the training forward did, every call).
- a large call compiles only its layout's walk (first calls compiled both), and two
  per-channel functions (a dozen, each compiled apart); a small call after it compiles only
  the whole-pass function (it compiled a copy of every step, of both walks), which compiles
  no NumPy implementation, and an item's bounds and strides no function of their own; a
  problem's first calls on one thread compile no per-channel function.

Results are checked against the same call made serially in the same process.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIMIT_S = 600  # a cold numba cache compiles the kernels first (seconds; minutes under load)

PROBLEM = """
import numpy as np, cudnn_bn
from cudnn_bn.backends import cpu
cpu.THREADS_MIN_VALUES = cpu.PARALLEL_MIN_VALUES  # threads for this problem too
rng = np.random.default_rng(0)
x = rng.standard_normal((32, 64, 128), dtype=np.float32)  # 262144 values: a parallel call
dy = rng.standard_normal(x.shape, dtype=np.float32)
w, b = np.ones(64, np.float32), np.zeros(64, np.float32)

def passes():
    gi, gw, gb = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    return [np.asarray(a) for a in (gi, gw, gb, y, mean, invstd)]

def same(got, want):
    return all(np.array_equal(g, v) for g, v in zip(got, want, strict=True))

want = passes()
"""


def run_child(script: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter with at least two engine threads; ``env`` added
    (a value of ``""`` removes the variable). The working directory is ``/``, so that only
    ``PYTHONPATH`` says where the package is."""
    environ = dict(os.environ, NUMBA_NUM_THREADS="4", PYTHONPATH=str(REPO))
    environ.pop("OMP_NUM_THREADS", None)
    for key, value in env.items():
        if value:
            environ[key] = value
        else:
            environ.pop(key, None)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=LIMIT_S,
        env=environ, cwd="/",
    )  # fmt: skip


def assert_printed(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == expected.split(), (result.stdout, result.stderr[-3000:])


def test_forked_child_after_a_parallel_call():
    script = (
        PROBLEM
        + """
import os
pid = os.fork()
if pid == 0:
    os._exit(0 if same(passes(), want) else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    )
    assert_printed(run_child(script), "0")


LOCKS = {  # what another thread holds at the fork, and how the script takes it
    "compiling": "from numba.core.compiler_lock import global_compiler_lock as lock",
    "llvm_call": "from llvmlite.binding import ffi\nlock = ffi.lib._lock",
}


@pytest.mark.parametrize("held", LOCKS)
def test_forked_child_while_another_thread_holds_a_compile_lock(held):
    """A fork while another thread compiles (holding numba's compiler lock) or makes an LLVM
    call (holding llvmlite's, as a new plan's look-up of its steps' addresses does outside
    numba's lock) waits for it: the child, inheriting the lock held by a thread it does not
    have, hung for ever at its own first compile or plan (found by an outsider's attack and
    by ``fuzz_runtime.py``'s forks while other threads called)."""
    script = f"""
import os, signal, threading, time
import numpy as np, cudnn_bn
from cudnn_bn.backends import cpu_pool  # what a first CPU call imports
{LOCKS[held]}

taken = threading.Event()

def holding():  # another thread's first call, compiling or looking its steps up
    with lock:
        taken.set()
        time.sleep(1)

threading.Thread(target=holding).start()
taken.wait()
pid = os.fork()
if pid == 0:
    import numba
    signal.alarm(60)  # a child that hangs ends (a cold cache compiles for long)
    numba.njit(lambda: 1)()  # its first compile
    x = np.ones((2, 3, 4), np.float32)
    ones = np.ones(3, np.float32)
    y = cudnn_bn.batch_norm_forward_inference(x, ones, 0 * ones, 0 * ones, ones)
    os._exit(0 if np.allclose(y, x / np.sqrt(1 + 1e-5)) else 3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    assert_printed(run_child(script), "0")


@pytest.mark.parametrize("setting", ["NUMBA_DISABLE_JIT=1", "NUMBA_NUM_THREADS=0"])
def test_a_numba_setting_the_engine_cannot_run_under_is_named_by_the_error(setting):
    """Under ``NUMBA_DISABLE_JIT=1`` the CPU engine cannot run (its kernels are numba
    intrinsics), and ``NUMBA_NUM_THREADS=0`` makes ``import numba`` raise its own ValueError
    (which names no variable): a call (twice: the import is tried again, and fails alike),
    and a C-API descriptor's creation, fail with NOT_IMPLEMENTED naming the setting; they
    were INTERNAL_ERROR ("'function' object has no attribute 'compile'", "unexpected
    ValueError"; found by outsiders' attacks)."""
    script = """
import ctypes, numpy as np, cudnn_bn
from cudnn_bn import InfiniError, capi
x, ones = np.ones((2, 3, 4), np.float32), np.ones(3, np.float32)
for _ in range(2):
    try:
        cudnn_bn.batch_norm_forward_inference(x, ones, ones, ones, ones)
    except InfiniError as exc:
        print(exc.status.name, SETTING in str(exc))
handle, desc, data = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
capi.infiniopCreateHandle(ctypes.byref(handle))
capi.infiniopCreateTensorDescriptor(ctypes.byref(desc), 1, (ctypes.c_size_t * 1)(3), None, 13)
capi.infiniopCreateTensorDescriptor(ctypes.byref(data), 2, (ctypes.c_size_t * 2)(2, 3), None, 13)
status = capi.infiniopCreateBatchNormForwardInferenceDescriptor(
    handle, ctypes.byref(ctypes.c_void_p()), data, data, desc, desc, desc, desc)
print(status, SETTING in capi.last_error())
""".replace("SETTING", repr(setting))
    name, _, value = setting.partition("=")
    printed = "NOT_IMPLEMENTED True NOT_IMPLEMENTED True 2 True"
    assert_printed(run_child(script, **{name: value}), printed)


def test_multiprocessing_pool_with_fork_after_a_parallel_call():
    script = (
        PROBLEM
        + """
import multiprocessing

def work(_):
    return same(passes(), want)

with multiprocessing.get_context("fork").Pool(2) as pool:
    print(*pool.map(work, range(4), chunksize=1))
"""
    )
    assert_printed(run_child(script), "True True True True")


def _layers() -> list:
    tbb = importlib.util.find_spec("tbb") is not None
    marks = pytest.mark.skipif(not tbb, reason="TBB is not installed")
    return ["workqueue", "omp", pytest.param("tbb", marks=marks)]


@pytest.mark.parametrize("layer", _layers())
def test_sixteen_threads_under_every_threading_layer(layer):
    script = (
        PROBLEM
        + """
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(16) as threads:
    print(all(threads.map(lambda _: same(passes(), want), range(32))))
"""
    )
    assert_printed(run_child(script, NUMBA_THREADING_LAYER=layer), "True")


NO_CACHE_SCRIPT = """
import warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import cudnn_bn
    x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
    w = np.ones(3, np.float32)
    gi, gw, gb = cudnn_bn.batch_norm_backward(x, x, w, None, None)
    y = cudnn_bn.batch_norm_forward_inference(x, w, w, w, w)
print(cudnn_bn.__file__, float(gb.sum()), y.shape)
print(*[str(w.message) for w in caught], sep="\\n")
"""


def test_no_writable_cache_location_compiles_in_memory_with_one_warning(tmp_path):
    """The package in a read-only place (its ``__pycache__`` cannot be made: a file is in
    the way, which stops root too), no writable home, ``NUMBA_CACHE_DIR`` unset."""
    package = tmp_path / "site" / "cudnn_bn"
    shutil.copytree(REPO / "cudnn_bn", package, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        (folder / "__pycache__").write_text("not a folder")
    for path in [*package.rglob("*"), package]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    script = NO_CACHE_SCRIPT
    try:
        result = run_child(
            script,
            PYTHONPATH=str(package.parent),
            HOME="/dev/null",
            XDG_CACHE_HOME="",
            NUMBA_CACHE_DIR="",
            PYTHONDONTWRITEBYTECODE="1",
        )
    finally:
        for path in [package, *package.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert result.returncode == 0, result.stderr[-3000:]
    first, *warnings = result.stdout.splitlines()
    assert first == f"{package / '__init__.py'} 276.0 (4, 3, 2)", result.stdout
    assert len(warnings) == 1 and "NUMBA_CACHE_DIR" in warnings[0], result.stdout


def _from_a_zip_without_cache(tmp_path, script: str, **env: str):
    """``(zip, result)``: ``script`` run in a child importing the package from a zip of it,
    with no writable home and ``NUMBA_CACHE_DIR`` a path under a file (``env`` added)."""
    packed = tmp_path / "cudnn_bn.zip"
    with zipfile.ZipFile(packed, "w") as archive:
        for path in (REPO / "cudnn_bn").rglob("*.py"):
            archive.write(path, path.relative_to(REPO))
    result = run_child(
        script,
        PYTHONPATH=str(packed),
        HOME="/dev/null",
        XDG_CACHE_HOME="/dev/null",
        NUMBA_CACHE_DIR="/dev/null/numba",
        PYTHONDONTWRITEBYTECODE="1",
        **env,
    )
    return packed, result


def test_no_writable_cache_location_for_a_zip_import(tmp_path):
    """The package imported from a zip, no writable home, ``NUMBA_CACHE_DIR`` a path under
    a file: in memory with one warning, as from a folder. numba's locator for a zip takes
    the user's cache directory without checking it, and every call failed with
    INTERNAL_ERROR "unexpected NotADirectoryError" (found by an outsider's attack)."""
    packed, result = _from_a_zip_without_cache(tmp_path, NO_CACHE_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    first, *warnings = result.stdout.splitlines()
    assert first == f"{packed / 'cudnn_bn' / '__init__.py'} 276.0 (4, 3, 2)", result.stdout
    assert len(warnings) == 1 and "NUMBA_CACHE_DIR" in warnings[0], result.stdout


_WARNINGS_AS_ERRORS_SCRIPT = """
import numpy as np
import cudnn_bn
x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
w = np.ones(3, np.float32)
try:
    cudnn_bn.batch_norm_backward(x, x, w, None, None)
except RuntimeWarning as warning:  # the one warning, as the caller's filter makes it
    print("raised", "NUMBA_CACHE_DIR" in str(warning))
gi, gw, gb = cudnn_bn.batch_norm_backward(x, x, w, None, None)
print(float(gb.sum()), cudnn_bn.batch_norm_forward_inference(x, w, w, w, w).shape)
"""


def test_no_writable_cache_location_under_python_w_error(tmp_path):
    """The same zip import under ``python -W error``: the one warning is raised by the
    first call as the RuntimeWarning the caller's filter makes it, and later calls run.
    The warning was issued as the kernels module was imported, so the import failed, every
    call imported it again, and every call failed with INTERNAL_ERROR "unexpected
    RuntimeWarning" (found by an outsider's attack)."""
    _, result = _from_a_zip_without_cache(
        tmp_path, _WARNINGS_AS_ERRORS_SCRIPT, PYTHONWARNINGS="error"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["raised True", "276.0 (4, 3, 2)"], result.stdout


def test_calls_never_start_numbas_thread_pool():
    """Neither a small call (one item, in the calling thread) nor a large one (the engine's
    own threads) starts numba's parallel layer, whose threads would compete with the
    caller's (and make a later fork unsafe)."""
    script = (
        """
import numpy as np, cudnn_bn
from numba.np.ufunc import parallel
small = np.ones((8, 4), np.float32)
ones = np.ones(4, np.float32)
cudnn_bn.batch_norm_forward_training(small, ones, ones, ones.copy(), ones.copy())
cudnn_bn.batch_norm_backward(small, small, ones, None, None)
cudnn_bn.batch_norm_forward_inference(small, ones, ones, ones, ones)
print(parallel._is_initialized)
"""
        + PROBLEM
        + "print(parallel._is_initialized)"
    )
    assert_printed(run_child(script), "False False")


def test_a_layout_compiles_only_its_own_walk(tmp_path):
    """Large NCHW calls from an empty cache compile no channels-last walk (its loops were
    a third of the README block's first-call compile time)."""
    script = PROBLEM + (
        "from cudnn_bn.backends import cpu_kernels as k\n"
        "y = cudnn_bn.batch_norm_forward_inference(x, w, b, np.zeros(64, np.float32), w)\n"
        "walks = (k.item_sums_across, k.item_forward_across, k.item_backward_across)\n"
        "print([len(f.signatures) for f in walks])\n"
    )
    child = run_child(script, NUMBA_CACHE_DIR=str(tmp_path))
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[-3:] == ["[0,", "0,", "0]"]


NHWC_PROBLEM = PROBLEM + (  # the problem channels-last: the across walks
    "nhwc = np.moveaxis(np.moveaxis(x.reshape(32, 64, 8, 16), 1, -1).copy(), -1, 1)\n"
)

COMPILES = """
from numba.core import event
compiled, every, others, depth = set(), set(), set(), [0]

class Compiles(event.Listener):
    \"\"\"Names of the engine's functions compiled: at the top (their callees' compiles
    are part of theirs), and at every depth; anything else compiled (``others``).\"\"\"

    def on_start(self, ev):
        depth[0] += 1

    def on_end(self, ev):
        depth[0] -= 1
        function = ev.data["dispatcher"].py_func
        if function.__module__ == "cudnn_bn.backends.cpu_pool":  # its threads' spin-wait
            return
        if function.__module__ != "cudnn_bn.backends.cpu_kernels":
            others.add(function.__module__ + "." + function.__qualname__)
        elif "<" in function.__qualname__:  # an overload's implementation, a closure
            others.add(function.__qualname__)
        else:
            every.add(function.__name__)
            if not depth[0]:
                compiled.add(function.__name__)

event.register("numba:compile", Compiles())
"""


def test_large_calls_compile_their_walk_and_the_per_channel_steps_only(tmp_path):
    """From an empty cache, a large backward and training forward compile the three item
    kernels of their walk, two per-channel functions and the pass that calls them on the
    engine's threads (a dozen per-channel functions, compiled apart, were most of the
    README block's first-call time)."""
    script = COMPILES + PROBLEM + "print(sorted(compiled))\n"
    steps = "['blocks_pass', 'channel_results', 'copy_channels', 'item_backward_along',"
    steps += " 'item_forward_along', 'item_sums_along']"
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), steps)


def test_each_helper_compiles_once(tmp_path):
    """A helper the item kernels call is compiled once per dtype and called, not once per
    kind of argument at its call sites, in either walk: numba compiled ``_next_item``
    again for the literal -1 of a first claim, and ``_column`` for the literal 0 of the
    backward's channel strides (0.05-0.1 s of a first call each)."""
    script = PROBLEM + (
        "nhwc = np.moveaxis(x.reshape(32, 64, 8, 16), 1, -1).copy()\n"
        "nhwc = np.moveaxis(nhwc, -1, 1)  # channels last: the walk across channels\n"
        "cudnn_bn.batch_norm_backward(nhwc, nhwc, w, None, None)\n"
        "cudnn_bn.batch_norm_forward_training(nhwc, w, b, None, None)\n"
        "from numba.core.registry import CPUDispatcher\n"
        "from cudnn_bn.backends import cpu_kernels as k\n"
        "functions = [f for f in vars(k).values() if isinstance(f, CPUDispatcher)]\n"
        "print(sorted(f.__name__ for f in functions if len(f.signatures) > 1))\n"
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "[]")


def test_conversions_and_views_compile_no_function_of_their_own(tmp_path):
    """Element conversions (F16/BF16 bits, rounding) and views of raw pointers are
    intrinsics, written into the kernels that use them: a large call compiles no function
    for them (each overload's lambda and numba's ``carray`` went through numba's whole
    pipeline on first use, about 0.5 s of the README block's 4 s)."""
    script = COMPILES + PROBLEM + "print(sorted(others))\n"
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "[]")


def test_the_forward_across_channels_compiles_no_function_outside_the_engine(tmp_path):
    """The channels-last forward's coefficient tables are ``zeros`` views, not
    ``np.full``, and its bound is taken without ``min``: those compiled numba's
    implementations (0.35 s of a first F32 call, F16 the same again)."""
    script = (
        COMPILES
        + NHWC_PROBLEM
        + (
            "for data in (nhwc, nhwc.astype(np.float16)):\n"
            "    cudnn_bn.batch_norm_forward_training(data, w, b, None, None)\n"
            "print(sorted(others))\n"
        )
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "[]")


def test_the_across_walks_are_written_into_their_kernels(tmp_path):
    """``_sums_across``, ``_forward_across`` and ``_backward_across`` are inlined into the
    item kernel that calls each, not compiled apart (then linked in and optimized again:
    0.2-0.5 s each of a first channels-last call, per dtype)."""
    script = (
        COMPILES
        + NHWC_PROBLEM
        + (
            "cudnn_bn.batch_norm_backward(nhwc, nhwc, w, None, None)\n"
            "cudnn_bn.batch_norm_forward_training(nhwc, w, b, None, None)\n"
            "walks = {'_sums_across', '_forward_across', '_backward_across'}\n"
            "print(sorted(every & walks), sorted(compiled & {'item_sums_across'}))\n"
        )
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "[] ['item_sums_across']")


def test_an_items_bounds_and_strides_compile_no_function_of_their_own(tmp_path):
    """What an item's loops read from its bounds and the strides (``_walk``, ``_column``,
    ``_channel_offsets``) are intrinsics: as helpers each was compiled apart on first use
    (0.3 s of the README block's 3.4 s with the kernels' calls to them)."""
    script = (
        COMPILES
        + NHWC_PROBLEM
        + (
            "cudnn_bn.batch_norm_backward(nhwc, nhwc, w, None, None)\n"
            "print(sorted(every & {'_walk', '_column', '_channel_offsets'}))\n"
        )
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "[]")


def test_only_the_kernels_have_cache_entries(tmp_path):
    """Helpers (functions only the kernels call) are linked into each kernel that calls
    them, and that is cached: entries of their own were looked up and written on first
    use (about 15 ms each) and never read."""
    child = run_child(PROBLEM, NUMBA_CACHE_DIR=str(tmp_path))
    assert child.returncode == 0, child.stderr[-3000:]
    names = sorted({p.name.split("-")[0].split(".")[-1] for p in tmp_path.rglob("*.nbi")})
    kernels = ["blocks_pass", "channel_results", "copy_channels", "item_backward_along"]
    kernels += ["item_forward_along"]
    assert names == ["_await", *kernels, "item_sums_along"]  # _await: cpu_pool's spin-wait


def test_one_per_channel_copy_serves_every_dtype(tmp_path):
    """The per-channel tensors' dtype is a runtime choice: F32 and F16 data share one
    compiled ``copy_channels`` (half data compiled one of its own, 0.5 s of its first call)."""
    script = PROBLEM + (
        "from cudnn_bn.backends import cpu_kernels as k\n"
        "cudnn_bn.batch_norm_forward_training(x.astype(np.float16), w, b, None, None)\n"
        "print(len(k.copy_channels.signatures))\n"
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "1")


def test_a_small_call_compiles_no_numpy_implementation(tmp_path):
    """The whole-pass function's scratch and views are intrinsics (``zeros``, ``carve``):
    its ``np.empty``, slices and ``reshape`` compiled numba's implementations of them apart
    (``np.empty`` two functions, ``reshape`` two subroutines; 0.4-0.5 s of a first small
    call, half of the whole-pass function's compile)."""
    script = COMPILES + (
        "from numba.core.base import BaseContext\n"
        "subroutines, compile_subroutine = [], BaseContext.compile_subroutine\n"
        "def counted(self, builder, impl, sig, *args, **kws):\n"
        "    subroutines.append(impl.__name__)\n"
        "    return compile_subroutine(self, builder, impl, sig, *args, **kws)\n"
        "BaseContext.compile_subroutine = counted\n"
        "import numpy as np, cudnn_bn\n"
        "x, w = np.ones((4, 8, 16), np.float32), np.ones(8, np.float32)\n"
        "cudnn_bn.batch_norm_forward_training(x, w, w, w.copy(), w.copy())\n"
        "cudnn_bn.batch_norm_backward(x, x, w, None, None)\n"
        "cudnn_bn.batch_norm_forward_inference(x, w, w, w, w)\n"
        "print(sorted(others), sorted(set(subroutines)))\n"
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "[] []")


def test_a_problems_first_calls_compile_no_one_call_pass(tmp_path):
    """The first calls of a problem of 65536 values or more on one thread (the README's first
    block) run the steps from Python and compile no one-call pass: its 0.4 s was an eighth
    of that block's first run, and it saves microseconds a call. After ``STEPWISE_CALLS``
    calls the problem compiles it, and gives the same results."""
    script = COMPILES + (
        "import numpy as np, cudnn_bn\n"
        "from cudnn_bn.backends import cpu\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.standard_normal((32, 64, 8, 8), dtype=np.float32)\n"
        "dy = rng.standard_normal(x.shape, dtype=np.float32)\n"
        "w, b = rng.uniform(0.5, 2, 64).astype(np.float32), np.zeros(64, np.float32)\n"
        "def passes():\n"
        "    out = cudnn_bn.batch_norm_backward(x, dy, w, None, None)\n"
        "    out += cudnn_bn.batch_norm_forward_training(x, w, b, b.copy(), w.copy())\n"
        "    out += (cudnn_bn.batch_norm_forward_inference(x, w, b, b, w),)\n"
        "    return [np.asarray(a) for a in out]\n"
        "first = passes()\n"
        "print('whole_pass' in every)\n"
        "for _ in range(getattr(cpu, 'STEPWISE_CALLS', 8)):\n"
        "    later = passes()\n"
        "print('whole_pass' in every)\n"
        "print(all(np.array_equal(f, g) for f, g in zip(first, later, strict=True)))\n"
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "False True True")


def test_a_small_call_compiles_no_kernel_of_its_own(tmp_path):
    """After large calls, small calls of the same dtype and walk compile only the whole-pass
    function: it calls the large calls' compiled steps (the one-call passes compiled a copy
    of every step, of both walks, about 5 s per dtype)."""
    script = (
        COMPILES
        + PROBLEM
        + (
            "every.clear()\n"
            "small, few = x[:2, :, :8].copy(), dy[:2, :, :8].copy()\n"  # 1024 values, NCL
            "cudnn_bn.batch_norm_backward(small, few, w, None, None)\n"
            "cudnn_bn.batch_norm_forward_training(small, w, b, None, None)\n"
            "print(sorted(every))\n"
        )
    )
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), "['whole_pass']")


def test_a_problems_first_calls_compile_no_per_channel_step(tmp_path):
    """The first calls of a problem on one thread (the README's first block: (32, 64, 8, 8))
    compile the item kernels of their walk alone, and neither threaded pass: the per-channel
    copies are NumPy's and the per-channel results run in the interpreter
    (``cpu._per_channel_steps``; their compiles were 1 s of that block's
    4.9 s). ``copy_channels`` and ``channel_results`` were compiled (fails there)."""
    script = COMPILES + (
        "import numpy as np, cudnn_bn\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.standard_normal((32, 64, 8, 8), dtype=np.float32)\n"
        "w, b = np.ones(64, np.float32), np.zeros(64, np.float32)\n"
        "cudnn_bn.batch_norm_backward(x, x, w, None, None)\n"
        "cudnn_bn.batch_norm_forward_training(x, w, b, b.copy(), w.copy())\n"
        "cudnn_bn.batch_norm_forward_inference(x, w, b, b, w)\n"
        "print(sorted(compiled))\n"
    )
    steps = "['item_backward_along', 'item_forward_along', 'item_sums_along']"
    assert_printed(run_child(script, NUMBA_CACHE_DIR=str(tmp_path)), steps)
