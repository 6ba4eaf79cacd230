"""A stand-in ``cupy`` that runs the CuPy engines' own CUDA C++ kernels on the host.

The NVIDIA backend's CuPy engines use a small part of CuPy: views of raw device memory,
``ElementwiseKernel``, ``ReductionKernel``, streams and the device calls. Here "device
memory" is host memory (NumPy buffers, addressed by their integer pointers) and every kernel
is compiled with ``g++``, its body as written, CUDA's few device builtins shimmed, and run
over NumPy views with CuPy's broadcasting. Real CuPy (which builds kernel objects without a
GPU) parses the parameter lists, so a typo there fails here as it would on a GPU.

This shows, without a GPU, that the engines compute the right thing end to end: the workspace
slices, views, strides, dtypes and the order of their passes. It cannot show anything about
CUDA itself (launches, NVRTC, streams, a parallel reduction's order): the ``gpu`` tests do.
"""

import ctypes
import hashlib
import subprocess
import types
from contextlib import nullcontext
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

# Offsets of every array operand at a flat index over some of the axes: ``axes`` extents in
# ``shape``, each operand's byte strides for them in ``strides[operand * axes + axis]``.
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
    'extern "C" void run(long n_outer, int outer_axes, const long *outer_shape, '
    "const long *outer_strides, long n_inner, int inner_axes, const long *inner_shape, "
    "const long *inner_strides, char **base, const double *scalars)"
)


class HostKernels:
    """Compiles kernel sources with ``g++`` into ``directory``, each source once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._loaded: dict[str, ctypes.CDLL] = {}

    def load(self, source: str) -> Any:
        key = hashlib.sha256(source.encode()).hexdigest()[:20]
        if key not in self._loaded:
            src, lib = self.directory / f"{key}.cpp", self.directory / f"{key}.so"
            src.write_text(source)
            result = subprocess.run(
                ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)],
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


def _launch(fn: Any, arrays: list, scalars: list, shape: tuple, inner: tuple) -> None:
    """Run ``fn`` over ``shape``, the ``inner`` axes reduced; a reduction's output (the last
    operand) has the kept axes only."""
    outer = [d for d in range(len(shape)) if d not in inner]
    outer_shape, inner_shape = [shape[d] for d in outer], [shape[d] for d in inner]
    outer_strides, inner_strides = [], []
    for k, (_, array) in enumerate(arrays):
        if inner and k == len(arrays) - 1:
            outer_strides += np.broadcast_to(array, outer_shape).strides
            inner_strides += [0] * len(inner)
        else:
            full = np.broadcast_to(array, shape).strides
            outer_strides += [full[d] for d in outer]
            inner_strides += [full[d] for d in inner]
    longs = lambda values: (ctypes.c_long * max(len(values), 1))(*values)  # noqa: E731
    fn(
        ctypes.c_long(int(np.prod(outer_shape))),
        len(outer),
        longs(outer_shape),
        longs(outer_strides),
        ctypes.c_long(int(np.prod(inner_shape))),
        len(inner),
        longs(inner_shape),
        longs(inner_strides),
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
            "for (long i = 0; i < n_outer; ++i) {",
            f"offsets(i, outer_axes, outer_shape, {len(arrays)}, outer_strides, at);",
            _declarations(placeholders, arrays, scalars, outputs),
            k.operation + ";",
            "}",
        ]
        _launch(self.compiler.load(_source(k, arrays, lines)), arrays, scalars, shape, ())


class ReductionKernel:
    """``cupy.ReductionKernel``, run on the host: map, reduce and post-map as CuPy names them
    (``a`` the running value, ``b`` the next), in index order over the reduced axes."""

    def __init__(self, compiler: HostKernels, real: Any) -> None:
        self.compiler, self.real = compiler, real

    def __call__(self, *args: Any, axis: tuple[int, ...], out: np.ndarray) -> None:
        k = self.real
        placeholders, arrays, scalars = _bind([*k.in_params, *k.out_params], [*args, out])
        shape = np.broadcast_shapes(*(a.shape for _, a in arrays[:-1]))
        kept = tuple(n for d, n in enumerate(shape) if d not in axis)
        if out.shape != kept:
            raise ValueError(f"out: shape {out.shape}, reduced shape {kept}")
        n = len(arrays)
        declared = _declarations(placeholders, arrays, scalars, {p.name for p in k.out_params})
        lines = [
            f"long outer_at[{n}], inner_at[{n}];",
            f"typedef {k.reduce_type} type_reduce;",
            "for (long i = 0; i < n_outer; ++i) {",
            f"offsets(i, outer_axes, outer_shape, {n}, outer_strides, outer_at);",
            f"type_reduce a = type_reduce({k.identity});",
            "for (long j = 0; j < n_inner; ++j) {",
            f"offsets(j, inner_axes, inner_shape, {n}, inner_strides, inner_at);",
            f"for (int q = 0; q < {n}; ++q) at[q] = outer_at[q] + inner_at[q];",
            "{",
            declared,
            f"type_reduce b = type_reduce({k.map_expr});",
            f"a = {k.reduce_expr};",
            "}}",
            f"for (int q = 0; q < {n}; ++q) at[q] = outer_at[q];",
            "{",
            declared,
            k.post_map_expr + ";",
            "}}",
        ]
        _launch(self.compiler.load(_source(k, arrays, lines)), arrays, scalars, shape, tuple(axis))


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


def module(directory: Path) -> types.ModuleType:
    """A ``cupy`` module for ``sys.modules``: one device (0), kernels compiled into
    ``directory``. Needs the real CuPy importable (to parse kernel parameters) and g++."""
    import cupy as real_cupy

    compiler = HostKernels(directory)
    streams = types.SimpleNamespace(ptr=0)
    runtime = types.SimpleNamespace(
        CUDARuntimeError=_RuntimeError,
        getDeviceCount=lambda: 1,
        getDevice=lambda: 0,
        setDevice=lambda device_id: None,
    )
    cuda = types.SimpleNamespace(
        runtime=runtime,
        UnownedMemory=_UnownedMemory,
        MemoryPointer=_MemoryPointer,
        Stream=types.SimpleNamespace(null=nullcontext()),
        ExternalStream=lambda stream, device_id: nullcontext(),
        get_current_stream=lambda device_id=-1: streams,
    )
    fake = types.ModuleType("cupy", "CuPy's kernels run on the host (tests/cupy_on_host.py)")
    fake.cuda = cuda
    fake.ndarray = _host_ndarray
    fake.ElementwiseKernel = lambda *a, **kw: ElementwiseKernel(
        compiler, real_cupy.ElementwiseKernel(*a, **kw)
    )
    fake.ReductionKernel = lambda *a, **kw: ReductionKernel(
        compiler, real_cupy.ReductionKernel(*a, **kw)
    )
    return fake
