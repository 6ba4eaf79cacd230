"""``make bench``: the benchmark of the engine this machine has, then the per-call one.

Where a CUDA GPU is usable (CuPy sees a device, libcudnn loads, torch is a CUDA build), the
GPU benchmark (``bench_gpu``: ``bench_bn.py``); otherwise the CPU engine's (``bench_cpu.py``),
saying why. Arguments after the script name go to the chosen benchmark. Then the per-call
benchmark of tiny problems (``bench_calls.py``), given the same ``--out`` if there is one
and ``--quick`` for the others' dry runs (``--quick``, ``--dry-run``).
A failure is one line naming what went wrong, not a traceback.
"""

import argparse
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def gpu_unusable() -> str | None:
    """Why the GPU benchmark cannot run here, or None when it can."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed ({exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    import cudnn_bn

    if not cudnn_bn.nvidia_available():
        return "cudnn_bn's NVIDIA backend is not usable (CuPy or libcudnn missing)"
    return None


def run(script: Path, args: list[str]) -> int:
    """Run ``script`` in this process with ``args``: its exit status."""
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except Exception as exc:  # a benchmark's failure, said in one line
        print(f"{script.name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    reason = gpu_unusable()
    script = HERE / ("bench_cpu.py" if reason else "bench_bn.py")
    if reason:
        print(f"No GPU benchmark: {reason}. Benchmarking the CPU engine instead.", flush=True)
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    args = sys.argv[1:]
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--out")
    shared.add_argument("--quick", "--dry-run", action="store_true")
    given = shared.parse_known_args(args)[0]
    calls_args = (["--out", given.out] if given.out else []) + (["--quick"] * given.quick)
    status = run(script, args)
    return run(HERE / "bench_calls.py", calls_args) or status


if __name__ == "__main__":
    sys.exit(main())
