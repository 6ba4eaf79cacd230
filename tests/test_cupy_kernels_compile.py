"""The CuPy engine's CUDA kernels compile, for every dtype combination the engines use.

No GPU is needed: CuPy builds kernel objects without a device, and NVRTC compiles without
one. Each elementwise kernel's body is compiled inside a function that declares its
parameters with the concrete types CuPy would substitute for the placeholders, against
CuPy's own ``float16`` header; the reductions' raw kernels (``cupy_reductions.py``) and the
batched backward's gather (``gather.py``) compile as they are, with no header. What this
cannot check, the GPU tests do: CuPy's parsing of the parameter lists and the results.
"""

import os
import sys
from pathlib import Path

import pytest

from cudnn_bn.backends import cupy_kernels as kern
from cudnn_bn.backends import cupy_reductions as red
from cudnn_bn.backends import gather
from cudnn_bn.enums import DataType

F16, BF16, F32, F64 = DataType.F16, DataType.BF16, DataType.F32, DataType.F64
STORAGE = {F16: "float16", BF16: "unsigned short", F32: "float", F64: "double"}
ARCH = "-arch=compute_80"


def _include_dirs() -> list[str]:
    """CuPy's headers and a directory holding cuda_fp16.h (which CuPy's float16 needs)."""
    cupy = pytest.importorskip("cupy")
    found = [Path(cupy.__file__).parent / "_core" / "include"]
    candidates = [Path(p) / "nvidia" / "cuda_runtime" / "include" for p in sys.path]
    candidates += [Path(os.environ.get("CUDA_PATH", "/usr/local/cuda")) / "include"]
    headers = next((c for c in candidates if (c / "cuda_fp16.h").exists()), None)
    if headers is None:
        pytest.skip("no cuda_fp16.h (pip install nvidia-cuda-runtime-cu12, or set CUDA_PATH)")
    return [str(p) for p in (*found, headers)]


def _nvrtc():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception as exc:  # the library is not loadable here
        pytest.skip(f"NVRTC is not usable: {exc}")
    return nvrtc


def compile_source(source: str) -> None:
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(source, "check.cu", [], [])
    options = [ARCH, *(f"-I{d}" for d in _include_dirs())]
    try:
        nvrtc.compileProgram(program, options)
    except nvrtc.NVRTCError:
        pytest.fail(f"NVRTC rejected:\n{source}\n{nvrtc.getProgramLog(program)}")


def harness(kernel, types: dict[str, str]) -> str:
    """A __global__ function declaring an elementwise ``kernel``'s parameters with concrete
    ``types`` and running its body."""
    lines = ["#include <cupy/float16.cuh>", kernel.preamble, 'extern "C" __global__ void check() {']
    lines += [f"    typedef {ctype} {placeholder};" for placeholder, ctype in types.items()]
    for param in (*kernel.in_params, *kernel.out_params):
        lines.append(f"    {param.ctype} {param.name} = {param.ctype}();")
    lines.append(f"    {kernel.operation};")
    lines.append("}")
    return "\n".join(lines)


def combos():
    """(data dtype, per-channel dtype, compute type) as the engines pair them."""
    for x in (F16, BF16, F32, F64):
        for channel in (x, F32) if x in (F16, BF16) else (x,):
            yield x, channel, kern.acc_type(x)


def cases():
    for x, channel, acc in combos():
        s, a, c = STORAGE[x], acc, STORAGE[channel]
        tag = f"{x.name}-{channel.name}"
        yield f"convert-{tag}", kern._convert_kernel(channel, x), {"S": c, "D": s}
        yield f"convert-back-{tag}", kern._convert_kernel(x, channel), {"S": s, "D": c}
        yield f"invstd-{tag}", kern._invstd_kernel(channel, acc), {"S": c, "A": a}
        scratch = F64 if x == F64 else F32  # where a masked-off parameter gradient goes
        for grad in {channel, scratch}:
            kernel = kern._finish_kernel(channel, grad, grad, acc)
            g = STORAGE[grad]
            yield f"finish-{grad.name}-{tag}", kernel, {"W": c, "A": a, "G": g, "H": g}
        for fused in (False, True):
            yield (
                f"grad-input-{int(fused)}-{tag}",
                kern._grad_input_kernel(x, acc, fused),
                {"S": s, "A": a},
            )
        yield f"masked-grad-{tag}", kern._masked_grad_kernel(x, acc), {"S": s}
        yield f"scale-{tag}", kern._scale_kernel(channel, acc), {"W": c, "A": a}
        for add, relu in ((False, False), (False, True), (True, True)):
            kernel = kern._normalize_kernel(x, channel, acc, add, relu)
            yield f"normalize-{int(add)}{int(relu)}-{tag}", kernel, {"S": s, "A": a, "B": c}
        running_acc = "double" if channel == F64 else "float"
        yield f"running-{tag}", kern._running_update_kernel(channel, running_acc), {"A": a, "R": c}


CASES = list(cases())


@pytest.mark.parametrize(("kernel", "types"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_compiles(kernel, types):
    compile_source(harness(kernel, types))


def raw_cases():
    """Both stages of every reduction kind and dtype; the stage-1 variants (fused, number of
    merged axes, 64-bit indices) spread over them, each variant compiled at least once."""
    index = 0
    for x, acc in ((x, kern.acc_type(x)) for x in (F16, BF16, F32, F64)):
        for kind in red.KINDS:
            name = f"cudnn_bn_{kind}_{x.name}"
            yield f"finish-{kind}-{x.name}", red._finish_source(name, x, acc, kind), name
            for fused in (False, True) if kind != "statistics" else (False,):
                axes, wide = 1 + index % 4, bool(index // 4 % 2)
                index += 1
                source = red._sums_source(name, x, acc, fused, kind, axes, wide)
                yield f"sums-{kind}-{int(fused)}-{axes}-{int(wide)}-{x.name}", source, name


RAW_CASES = list(raw_cases())


@pytest.mark.parametrize(
    ("source", "name"), [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES]
)
def test_raw_kernel_compiles(source, name):
    assert f'extern "C" __global__ void {name}(' in source
    compile_source(source)


@pytest.mark.parametrize("index", ["int", "long long"])
@pytest.mark.parametrize("count", range(1, 10))
def test_the_batched_gather_kernel_compiles(count, index):
    """``backends/gather.py``'s kernel for 1 to 9 operand pointers (the batched backward's
    operands), in 32-bit and 64-bit index arithmetic; ``tests/test_gather_on_host.py`` runs
    it, compiled by g++, on host memory."""
    name = f"cudnn_bn_gather_{count}"
    source = gather._source(name, count, index)
    assert f'extern "C" __global__ void {name}(' in source
    compile_source(source)


def test_a_broken_body_is_caught():
    """The harness fails on a bad body, so a passing kernel means something."""
    kernel = kern._convert_kernel(F32, F16)
    broken = harness(kernel, {"S": "float", "D": "float16"}).replace("y = ", "y = undeclared + ")
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(broken, "check.cu", [], [])
    with pytest.raises(nvrtc.NVRTCError):
        nvrtc.compileProgram(program, [ARCH, *(f"-I{d}" for d in _include_dirs())])
