"""Host overhead of the cached-descriptor call path, measured without a GPU.

Every cuDNN call goes to the stub libcudnn the tests compile (``tests/cudnn_stub.py``), which
returns at once, and the CUDA seam answers without a device; what is left is this package's
own Python work per ``compute``: argument checks, the argument template, ctypes conversion,
handle and stream. It is a floor for the per-call host time on a GPU machine (where cuDNN's
own host work and the launch are added) and needs only gcc, so it runs anywhere.

    PYTHONPATH=. python benchmarks/host_overhead_stub.py [--calls N] [--out FILE.md]
"""

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from stand_ins import cudnn_stub, helpers, stub_cudnn

import cudnn_bn
from cudnn_bn import DataType, Device, Handle, Mode, TensorDesc

SHAPE = (1, 16, 16)  # the bench's tiny case
REPEATS = 7


def per_call_us(call: Callable[[], None], calls: int) -> float:
    """The median over ``REPEATS`` runs of ``calls`` back-to-back calls, in µs per call."""
    for _ in range(calls // 10):
        call()
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def compute_calls() -> dict[str, Callable[[], None]]:
    """One bound ``compute`` per operator, on the stub's fake pointers (F32 data, no staging)."""
    p, handle = cudnn_stub.POINTERS, Handle(Device.NVIDIA, 0)
    x = TensorDesc.contiguous(DataType.F32, SHAPE)
    c = TensorDesc.contiguous(DataType.F32, (SHAPE[1],))
    backward = cudnn_bn.BatchNormBackwardDescriptor(
        handle, x, c, c, x, x, c, c, c, mode=Mode.SAVED_INVSTD
    )
    training = cudnn_bn.BatchNormForwardTrainingDescriptor(handle, x, c, c, x, c, c, c, c)
    inference = cudnn_bn.BatchNormForwardInferenceDescriptor(handle, x, x, c, c, c, c)
    ws, stream = cudnn_stub.WORKSPACE, cudnn_stub.STREAM

    def pointers(names: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(p[name] for name in names)

    b = (ws, backward.workspace_size, *pointers(helpers.BACKWARD_ORDER))
    t = (
        ws,
        training.workspace_size,
        p["reserve"],
        training.reserve_size,
        *pointers(helpers.TRAINING_ORDER),
    )
    i = (ws, inference.workspace_size, *pointers(helpers.INFERENCE_ORDER))
    return {
        "BatchNormBackward.compute": lambda: backward.compute(*b, stream=stream),
        "BatchNormForwardTraining.compute": lambda: training.compute(*t, stream=stream),
        "BatchNormForwardInference.compute": lambda: inference.compute(*i, stream=stream),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out", type=Path, help="also write the table as Markdown here")
    args = parser.parse_args()
    with stub_cudnn():
        rows = [(name, per_call_us(call, args.calls)) for name, call in compute_calls().items()]
    lines = [
        "# Host overhead per compute, against the stub libcudnn (no GPU)",
        "",
        f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"input {SHAPE} F32; median of {REPEATS} runs of {args.calls} back-to-back calls.",
        f"Command: `PYTHONPATH=. python benchmarks/host_overhead_stub.py --calls {args.calls}`",
        "",
        "| call | µs per call |",
        "|---|---|",
        *(f"| `{name}` | {us:.2f} |" for name, us in rows),
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
