"""A stand-in ``cupy`` that runs the CuPy engines' own CUDA C++ kernels on the host.

The NVIDIA backend's CuPy engines use a small part of CuPy: views of raw device memory,
``ElementwiseKernel``, ``RawKernel``, streams, the device calls and copies from the host.
Here "device memory" is host memory (NumPy buffers, addressed by their integer pointers) and
every kernel is compiled with ``g++``, its body as written, CUDA's few device builtins
shimmed. Elementwise kernels run over NumPy views with CuPy's broadcasting; real CuPy (which
builds kernel objects without a GPU) parses their parameter lists, so a typo there fails
here as it would on a GPU. A ``RawKernel`` runs its grid block by block,
each block's threads as C++20 coroutines that all reach a ``__syncthreads()`` before any
passes it (``__shared__`` memory is shared by the block's threads); a barrier some threads
skip is an error, as it is undefined on a GPU. Every launch is recorded in ``launches``.

This shows, without a GPU, that the engines compute the right thing end to end: the workspace
slices, views, strides, dtypes, the order of their passes, the grids they launch. It cannot
show anything about CUDA itself (NVRTC, streams, warps, real concurrency): the ``gpu`` tests do.
"""

import ctypes
import hashlib
import re
import subprocess
import types
from pathlib import Path
from typing import Any

import numpy as np

C_TYPES = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
    np.dtype(np.uint16): "unsigned short",
    np.dtype(np.uint8): "unsigned char",
    np.dtype(np.bool_): "bool",
}

PROLOGUE = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
typedef _Float16 float16;
#define __device__
#define __forceinline__ inline
using std::max;
using std::min;
using std::sqrt;
static inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
"""

# Offsets of every array operand at a flat index: ``axes`` extents in ``shape``, each
# operand's byte strides in ``strides[operand * axes + axis]``.
OFFSETS = r"""
static void offsets(long index, int axes, const long *shape, int operands, const long *strides,
                    long *out) {
    for (int k = 0; k < operands; ++k) out[k] = 0;
    for (int d = axes - 1; d >= 0; --d) {
        long at = index % shape[d];
        index /= shape[d];
        for (int k = 0; k < operands; ++k) out[k] += at * strides[k * axes + d];
    }
}
"""

ENTRY = (
    'extern "C" void run(long n, int axes, const long *shape, const long *strides, '
    "char **base, const double *scalars)"
)


class HostKernels:
    """Compiles kernel sources with ``g++`` into ``directory``, each source once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._loaded: dict[str, ctypes.CDLL] = {}

    def load(self, source: str) -> Any:
        """The ``run`` entry point of ``source``, compiled as C++20."""
        key = hashlib.sha256(source.encode()).hexdigest()[:20]
        if key not in self._loaded:
            src, lib = self.directory / f"{key}.cpp", self.directory / f"{key}.so"
            src.write_text(source)
            result = subprocess.run(
                ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)],
                capture_output=True,
                text=True,
            )
            if result.returncode:
                raise AssertionError(f"g++ rejected a kernel:\n{source}\n{result.stderr}")
            self._loaded[key] = ctypes.CDLL(str(lib))
        return self._loaded[key].run


def _bind(params: list, args: list) -> tuple[dict[str, str], list, list[float]]:
    """The placeholder types CuPy would infer, and the array and scalar arguments in order.

    A placeholder takes the dtype of the arrays bound to it, which must agree (CuPy refuses
    mismatched inputs; the engines never rely on its casts).
    """
    placeholders: dict[str, str] = {}
    arrays, scalars = [], []
    for param, arg in zip(params, args, strict=True):
        if isinstance(arg, np.ndarray):
            if param.dtype is None:
                ctype = C_TYPES[arg.dtype]
                if placeholders.setdefault(param.ctype, ctype) != ctype:
                    raise TypeError(
                        f"{param.name}: {param.ctype} is {placeholders[param.ctype]} already, "
                        f"got {arg.dtype}"
                    )
            elif arg.dtype != param.dtype:
                raise TypeError(f"{param.name}: expected {param.dtype}, got {arg.dtype}")
            arrays.append((param, arg))
        elif param.dtype is None:
            raise TypeError(f"{param.name}: a scalar for the placeholder {param.ctype}")
        else:
            scalars.append((param, float(arg)))
    return placeholders, arrays, scalars


def _declarations(placeholders: dict[str, str], arrays: list, scalars: list, outputs: set) -> str:
    """C++ declaring each parameter as the kernel body sees it: inputs const, outputs not."""
    lines = [f"typedef {ctype} {name};" for name, ctype in placeholders.items()]
    for k, (param, _) in enumerate(arrays):
        const = "" if param.name in outputs else "const "
        lines.append(
            f"{const}{param.ctype} &{param.name} = *({param.ctype} *)(base[{k}] + at[{k}]);"
        )
    for k, (param, _) in enumerate(scalars):
        lines.append(f"const {param.ctype} {param.name} = ({param.ctype})scalars[{k}];")
    return "\n".join(lines)


def _launch(fn: Any, arrays: list, scalars: list, shape: tuple) -> None:
    """Run ``fn`` over every element of ``shape``, the arrays broadcast to it."""
    strides = [s for _, array in arrays for s in np.broadcast_to(array, shape).strides]
    longs = lambda values: (ctypes.c_long * max(len(values), 1))(*values)  # noqa: E731
    fn(
        ctypes.c_long(int(np.prod(shape))),
        len(shape),
        longs(shape),
        longs(strides),
        (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for _, a in arrays)),
        (ctypes.c_double * max(len(scalars), 1))(*(v for _, v in scalars)),
    )


def _source(kernel: Any, arrays: list, lines: list[str]) -> str:
    """A kernel's host program: shims, its preamble, and ``lines`` inside the entry point,
    where ``at`` holds each operand's byte offset for the element in hand."""
    head = [PROLOGUE, kernel.preamble, OFFSETS, ENTRY + " {", f"long at[{len(arrays)}];"]
    return "\n".join([*head, *lines, "}"])


class ElementwiseKernel:
    """``cupy.ElementwiseKernel``, run on the host: the body once per broadcast element."""

    def __init__(self, compiler: HostKernels, real: Any) -> None:
        self.compiler, self.real = compiler, real

    def __call__(self, *args: Any) -> None:
        k = self.real
        placeholders, arrays, scalars = _bind([*k.in_params, *k.out_params], list(args))
        shape = np.broadcast_shapes(*(a.shape for _, a in arrays))
        for param, out in arrays[-len(k.out_params) :]:
            if out.shape != shape:
                raise ValueError(f"{param.name}: shape {out.shape}, broadcast shape {shape}")
        outputs = {p.name for p in k.out_params}
        lines = [
            "for (long i = 0; i < n; ++i) {",
            f"offsets(i, axes, shape, {len(arrays)}, strides, at);",
            _declarations(placeholders, arrays, scalars, outputs),
            k.operation + ";",
            "}",
        ]
        _launch(self.compiler.load(_source(k, arrays, lines)), arrays, scalars, shape)


# A RawKernel's host program: CUDA's thread model on coroutines. ``__syncthreads()`` suspends
# the thread; the launcher resumes every thread of a block in turn, round after round.
RAW_PROLOGUE = r"""
#include <coroutine>
struct dim3 { unsigned x, y, z; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;
struct Thread {
    struct promise_type {
        Thread get_return_object() {
            return {std::coroutine_handle<promise_type>::from_promise(*this)};
        }
        std::suspend_always initial_suspend() noexcept { return {}; }
        std::suspend_always final_suspend() noexcept { return {}; }
        void return_void() {}
        void unhandled_exception() { __builtin_trap(); }
    };
    std::coroutine_handle<promise_type> handle;
};
struct Barrier {
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<>) const noexcept {}
    void await_resume() const noexcept {}
};
#define __global__
#define __shared__ static
#define __restrict__ __restrict
#define __syncthreads() co_await Barrier{}
"""

RAW_LAUNCHER = r"""
static dim3 coordinates(unsigned long i, dim3 extent) {
    return {(unsigned)(i % extent.x), (unsigned)(i / extent.x % extent.y),
            (unsigned)(i / extent.x / extent.y)};
}
extern "C" int run(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, void **args, const long *sizes) {
    @CHECKS@
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    const unsigned long blocks = (unsigned long)gx * gy * gz, threads = (unsigned long)bx * by * bz;
    static Thread block[1024];  /* CUDA's limit on threads per block */
    if (threads > 1024) return -1;
    for (unsigned long b = 0; b < blocks; ++b) {
        blockIdx = coordinates(b, gridDim);
        for (unsigned long t = 0; t < threads; ++t) {
            threadIdx = coordinates(t, blockDim);
            block[t] = @NAME@(@ARGS@);
        }
        for (;;) {
            unsigned long finished = 0;
            for (unsigned long t = 0; t < threads; ++t) {
                if (!block[t].handle.done()) {
                    threadIdx = coordinates(t, blockDim);
                    block[t].handle.resume();
                }
                finished += block[t].handle.done();
            }
            if (finished == threads) break;
            if (finished != 0) return 1;  /* a __syncthreads() some threads never reached */
        }
        for (unsigned long t = 0; t < threads; ++t) block[t].handle.destroy();
    }
    return 0;
}
"""

KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)\s*\{')


def _host_program(code: str, name: str) -> tuple[str, list[str]]:
    """``code`` with kernel ``name`` made a coroutine, and a launcher for it; the kernel's
    parameter types in order."""
    match = next(m for m in KERNEL.finditer(code) if m.group(1) == name)
    types = []
    for param in match.group(2).split(","):
        tokens = param.replace("*", " * ").replace("__restrict__", "").split()
        types.append(" ".join(tokens[:-1]))
    depth, end = 1, match.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(code[end], 0)
        end += 1
    body = code[match.end() : end - 1]
    kernel = f"static Thread {name}({match.group(2)}) {{{body}\nco_return;\n}}"
    program = code[: match.start()] + kernel + code[end:]
    args = ", ".join(f"*({t} *)args[{k}]" for k, t in enumerate(types))
    checks = " ".join(
        f"if (sizes[{k}] != (long)sizeof({t})) return {k + 2};" for k, t in enumerate(types)
    )
    launcher = RAW_LAUNCHER.replace("@NAME@", name).replace("@ARGS@", args)
    launcher = launcher.replace("@CHECKS@", checks)
    return "\n".join([PROLOGUE, RAW_PROLOGUE, program, launcher]), types


def _raw_argument(value: Any) -> tuple[Any, int]:
    """A kernel argument as CUDA passes it (a pointer for an array, the bytes of a scalar,
    Python numbers as CuPy converts them), and its size."""
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data), 8
    if type(value) in (bool, int, float):
        value = {bool: np.bool_, int: np.int64, float: np.float64}[type(value)](value)
    if not isinstance(value, np.generic):
        raise TypeError(f"unsupported kernel argument {value!r}")
    raw = value.tobytes()
    return ctypes.create_string_buffer(raw, len(raw)), len(raw)


class RawKernel:
    """``cupy.RawKernel``, run on the host (see the module's docstring); ``launches`` gets
    ``(name, grid, block)`` of every launch."""

    def __init__(self, compiler: HostKernels, launches: list, code: str, name: str,
                 **options: Any) -> None:  # fmt: skip
        self.compiler, self.launches, self.code, self.name = compiler, launches, code, name

    def __call__(self, grid: tuple, block: tuple, args: tuple, **options: Any) -> None:
        grid3, block3 = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
        self.launches.append((self.name, grid3, block3))
        source, types = _host_program(self.code, self.name)
        if len(types) != len(args):
            raise TypeError(f"{self.name} takes {len(types)} arguments, got {len(args)}")
        held = [_raw_argument(a) for a in args]
        addresses = (ctypes.c_void_p * len(held))(*(ctypes.addressof(h) for h, _ in held))
        sizes = (ctypes.c_long * len(held))(*(n for _, n in held))
        status = self.compiler.load(source)(
            *(ctypes.c_uint(v) for v in (*grid3, *block3)), addresses, sizes
        )
        if status == -1:
            raise ValueError(f"{self.name}: more than 1024 threads per block")
        if status == 1:
            raise AssertionError(f"{self.name}: threads of a block diverged at __syncthreads()")
        if status:
            raise TypeError(f"{self.name}: argument {status - 2} has the wrong size")


def _host_ndarray(shape: tuple, dtype: Any, memptr: Any, strides: tuple) -> np.ndarray:
    """``cupy.ndarray(shape, dtype, memptr, strides=)`` over host memory."""
    size = memptr.mem.size - (memptr.ptr - memptr.mem.ptr)
    buffer = (ctypes.c_char * size).from_address(memptr.ptr)
    return np.ndarray(shape, dtype, buffer=buffer, strides=strides)


class _UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: Any, device_id: int) -> None:
        self.ptr, self.size = ptr, size


class _MemoryPointer:
    def __init__(self, mem: _UnownedMemory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class _RuntimeError(Exception):
    pass


class _Stream:
    """A stream on the host: entering it does nothing, kernels run at once, and it is never
    capturing a CUDA graph."""

    def __init__(self, ptr: int = 0) -> None:
        self.ptr = ptr

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def is_capturing(self) -> bool:
        return False


def _memcpy(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    """``cudaMemcpyAsync`` between host addresses (host memory stands for the device's)."""
    ctypes.memmove(dst, src, size)


def module(directory: Path) -> types.ModuleType:
    """A ``cupy`` module for ``sys.modules``: one device (0), kernels compiled into
    ``directory``. Needs the real CuPy importable (to parse kernel parameters) and g++."""
    import cupy as real_cupy

    compiler = HostKernels(directory)
    launches: list = []
    streams = types.SimpleNamespace(ptr=0)
    runtime = types.SimpleNamespace(
        CUDARuntimeError=_RuntimeError,
        getDeviceCount=lambda: 1,
        getDevice=lambda: 0,
        setDevice=lambda device_id: None,
        memcpyAsync=_memcpy,
    )
    cuda = types.SimpleNamespace(
        runtime=runtime,
        UnownedMemory=_UnownedMemory,
        MemoryPointer=_MemoryPointer,
        Stream=types.SimpleNamespace(null=_Stream()),
        ExternalStream=lambda stream, device_id: _Stream(stream),
        get_current_stream=lambda device_id=-1: streams,
    )
    fake = types.ModuleType("cupy", "CuPy's kernels run on the host (tests/cupy_on_host.py)")
    fake.cuda = cuda
    fake.ndarray = _host_ndarray
    fake.ElementwiseKernel = lambda *a, **kw: ElementwiseKernel(
        compiler, real_cupy.ElementwiseKernel(*a, **kw)
    )
    fake.RawKernel = lambda code, name, **kw: RawKernel(compiler, launches, code, name, **kw)
    fake.launches = launches
    return fake
