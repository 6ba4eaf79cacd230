"""InfiniCore-style operator test for batch-norm backward, driving the C API ``cudnn_bn.capi``.

Laid out like InfiniCore's ``test/infiniop`` scripts: a case table, a dtype list, a tolerance
map, and the same flags. Each case fills torch tensors (strided ones included), hands their
raw pointers to ``infiniopBatchNormBackward`` and compares with
``torch.ops.aten.native_batch_norm_backward`` run in float64 on the host.

    python examples/infiniop_batch_norm_backward.py --cpu            # the CPU engine
    python examples/infiniop_batch_norm_backward.py --nvidia --profile --num_iterations 100
"""

import argparse
import sys
import time
from ctypes import byref, c_size_t, c_ssize_t, c_void_p
from math import prod

import torch

from cudnn_bn import DataType, Device, Status, capi

TRAIN, SAVED, EVAL = 0, 1, 2  # infiniopSetBatchNormBackwardAttributes' mode
_MODE_NAMES = {TRAIN: "train", SAVED: "saved", EVAL: "eval"}
EPS = 1e-5

# shape, strides of input / grad_output / grad_input (None: contiguous), per-channel stride, mode
_TEST_CASES = [
    ((13, 4, 5), None, None, None, 1, TRAIN),
    ((13, 2, 4), (10, 4, 1), (10, 4, 1), (10, 4, 1), 1, TRAIN),  # padded, as in InfiniCore
    ((13, 4, 5), (40, 10, 2), None, (20, 1, 4), 2, TRAIN),
    ((2, 16, 32), None, None, None, 1, TRAIN),
    ((16, 64, 256), None, None, None, 1, TRAIN),
    ((16, 3), None, None, None, 1, TRAIN),  # (N, C)
    ((16, 3), (1, 16), (1, 16), (1, 16), 3, TRAIN),
    ((2, 3, 5, 7), None, None, None, 1, TRAIN),  # (N, C, H, W)
    ((2, 3, 5, 7), (105, 1, 21, 3), None, (105, 1, 21, 3), 1, TRAIN),  # channels-last
    ((2, 3, 4, 5, 6), None, None, None, 1, TRAIN),  # (N, C, D, H, W)
    ((4, 8, 16), None, None, None, 1, SAVED),
    ((13, 2, 4), (10, 4, 1), (10, 4, 1), (10, 4, 1), 2, SAVED),
    ((4, 8, 16), None, None, None, 1, EVAL),
    ((13, 2, 4), (10, 4, 1), None, (10, 4, 1), 1, EVAL),
    ((2, 3, 5, 7), (105, 1, 21, 3), None, None, 1, EVAL),
]

_TENSOR_DTYPES = [DataType.F16, DataType.BF16, DataType.F32, DataType.F64]
_TORCH_DTYPES = dict(
    zip(_TENSOR_DTYPES, (torch.float16, torch.bfloat16, torch.float32, torch.float64), strict=True)
)
_TOLERANCE_MAP = {  # atol, rtol against the float64 reference
    DataType.F16: (1e-2, 1e-2),
    DataType.BF16: (1e-2, 1e-2),
    DataType.F32: (2e-5, 2e-5),
    DataType.F64: (1e-10, 1e-10),
}


class CallFailed(Exception):
    pass


def check(status: int, call: str) -> None:
    if status != Status.SUCCESS:
        raise CallFailed(f"{call} returned {Status(status).name}: {capi.last_error()}")


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Test infiniopBatchNormBackward")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (default)")
    parser.add_argument("--nvidia", action="store_true", help="run on NVIDIA GPU 0")
    parser.add_argument("--profile", action="store_true", help="time the operator and torch")
    nonnegative = lambda text: max(0, int(text))  # noqa: E731
    parser.add_argument("--num_prerun", type=nonnegative, default=10)
    parser.add_argument("--num_iterations", type=nonnegative, default=1000)
    parser.add_argument("--debug", action="store_true", help="print mismatching elements")
    return parser.parse_args()


def strided(shape, strides, dtype, device, values=None):
    """A tensor with the given strides (padding filled with NaN), holding ``values``."""
    strides = strides or [prod(shape[i + 1 :]) for i in range(len(shape))]
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    tensor = torch.full((span,), float("nan"), dtype=dtype, device=device)
    tensor = tensor.as_strided(shape, strides)
    return tensor if values is None else tensor.copy_(values)


def padding_intact(tensor) -> bool:
    """Whether the gaps between a strided output's elements still hold their NaN fill."""
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    covered = torch.zeros(span, dtype=torch.bool)
    covered.as_strided(tensor.shape, tensor.stride()).fill_(True)
    return bool(tensor.as_strided((span,), (1,)).cpu()[~covered].isnan().all())


def reference(x, dy, w, rm, rv, mode):
    """grad_input, grad_weight, grad_bias from torch in float64, on the host."""
    x, dy, w, rm, rv = (t.detach().cpu().double() for t in (x, dy, w, rm, rv))
    if mode == TRAIN:
        _, mean, invstd = torch.native_batch_norm(x, w, None, None, None, True, 0.0, EPS)
    elif mode == SAVED:
        mean, invstd = rm, (rv + EPS).rsqrt()
    else:
        mean = invstd = None
    return torch.ops.aten.native_batch_norm_backward(
        dy, x, w, rm, rv, mean, invstd, mode != EVAL, EPS, [True, True, True]
    )


def torch_backward(x, dy, w, rm, rv, mode):
    """torch's own backward in the case's dtype and device, for --profile."""
    mean = invstd = None
    if mode != EVAL:  # what a training forward saved (the same cost for saved statistics)
        _, mean, invstd = torch.native_batch_norm(x, w, None, None, None, True, 0.0, EPS)
    return lambda: torch.ops.aten.native_batch_norm_backward(
        dy, x, w, rm, rv, mean, invstd, mode != EVAL, EPS, [True, True, True]
    )


def debug(name, actual, expected, atol, rtol, limit=100):
    """Print the elements outside atol + rtol * |expected|, like InfiniCore's debug()."""
    delta = actual - expected
    bad = (delta.abs() > atol + rtol * expected.abs()) | actual.isnan()
    indices = bad.nonzero().tolist()
    for index in indices[:limit]:
        a, e, d = (float(t[tuple(index)]) for t in (actual, expected, delta))
        where = f"{name}{tuple(index)}"
        print(f"   > {where:<24} actual {a:<+20.12f} expect {e:<+20.12f} delta {d:+.3e}")
    if len(indices) > limit:
        print(f"   > ... {len(indices) - limit} more")
    print(
        f"   {name}: {len(indices)} / {actual.numel()} mismatched (atol {atol}, rtol {rtol}); "
        f"actual [{actual.min():.6g}, {actual.max():.6g}], "
        f"expected [{expected.min():.6g}, {expected.max():.6g}]"
    )


def sync(device) -> None:
    if device == Device.NVIDIA:
        torch.cuda.synchronize()


def timed(func, device, args) -> float:
    """Milliseconds per call after ``--num_prerun`` warm-up calls."""
    for _ in range(args.num_prerun):
        func()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.num_iterations):
        func()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / max(args.num_iterations, 1)


def make_tensors(case, dtype, device, rng):
    """grad_input, grad_weight, grad_bias (NaN-filled), input, grad_output, weight, running_*."""
    shape, x_strides, dy_strides, dx_strides, channel_stride, mode = case
    tdtype, cs = _TORCH_DTYPES[dtype], (channel_stride,)
    random = lambda *size: torch.rand(size, generator=rng, dtype=torch.float64)  # noqa: E731
    normal = lambda *size: torch.randn(size, generator=rng, dtype=torch.float64)  # noqa: E731
    make = lambda values, strides: strided(values.shape, strides, tdtype, device, values)  # noqa: E731
    x, dy = make(normal(*shape) * 2 + 1, x_strides), make(normal(*shape), dy_strides)
    w = make(random(shape[1]) + 0.5, cs)
    if mode == SAVED:  # the batch mean and biased variance a forward pass would have saved
        axes, x64 = [0, *range(2, len(shape))], x.cpu().double()
        rm, rv = make(x64.mean(axes), cs), make(x64.var(axes, correction=0), cs)
    else:  # InfiniCore's generator: random running statistics
        rm, rv = make(normal(shape[1]) * 0.5, cs), make(random(shape[1]) * 0.5 + 0.5, cs)
    dx = strided(shape, dx_strides, tdtype, device)
    dw, db = (strided((shape[1],), cs, tdtype, device) for _ in range(2))
    return dx, dw, db, x, dy, w, rm, rv


def test(handle, device, case, dtype, args, rng) -> bool:
    mode, is_gpu = case[-1], device == Device.NVIDIA
    tensors = make_tensors(case, dtype, "cuda" if is_gpu else "cpu", rng)
    dx, dw, db, x, dy, w, rm, rv = tensors
    descs, op, details, timings = [], c_void_p(), [], None
    try:
        for t in tensors:
            descs.append(c_void_p())
            n, shape, strides = t.dim(), t.shape, t.stride()
            check(
                capi.infiniopCreateTensorDescriptor(
                    byref(descs[-1]), n, (c_size_t * n)(*shape), (c_ssize_t * n)(*strides), dtype
                ),
                "infiniopCreateTensorDescriptor",
            )
        check(
            capi.infiniopCreateBatchNormBackwardDescriptor(handle, byref(op), *descs),
            "infiniopCreateBatchNormBackwardDescriptor",
        )
        check(
            capi.infiniopSetBatchNormBackwardAttributes(op, EPS, mode),
            "infiniopSetBatchNormBackwardAttributes",
        )
        size = c_size_t()
        check(
            capi.infiniopGetBatchNormBackwardWorkspaceSize(op, byref(size)),
            "infiniopGetBatchNormBackwardWorkspaceSize",
        )
        workspace = torch.empty(size.value, dtype=torch.uint8, device=x.device)
        workspace_ptr = workspace.data_ptr() if size.value else None
        stream = torch.cuda.current_stream().cuda_stream if is_gpu else None
        pointers = [t.data_ptr() for t in tensors]

        def run():
            check(
                capi.infiniopBatchNormBackward(op, workspace_ptr, size.value, *pointers, stream),
                "infiniopBatchNormBackward",
            )

        run()
        sync(device)
        atol, rtol = _TOLERANCE_MAP[dtype]
        ok, worst, ratio = True, 0.0, 0.0
        expected = reference(x, dy, w, rm, rv, mode)
        for name, got, want in zip(
            ("grad_input", "grad_weight", "grad_bias"), (dx, dw, db), expected, strict=True
        ):
            got = got.cpu().double()
            error = (got - want).abs()
            worst = max(worst, float(error.max()))
            ratio = max(ratio, float((error / (atol + rtol * want.abs())).max()))
            if not torch.allclose(got, want, rtol=rtol, atol=atol):
                ok = False
                details.append((name, got, want, atol, rtol))
        result = f"max_err={worst:.3e} ({ratio:.2f} of tolerance)"
        if not all(padding_intact(t) for t in (dx, dw, db)):
            ok, result = False, result + ", padding between strided outputs overwritten"
        if args.profile:
            timings = [timed(run, device, args)]
            try:
                timings.append(timed(torch_backward(x, dy, w, rm, rv, mode), device, args))
            except RuntimeError as exc:
                timings.append(str(exc).splitlines()[0])
    except CallFailed as exc:
        ok, result = False, str(exc)
    try:  # destroy everything that was created, checking each status
        if op:
            check(
                capi.infiniopDestroyBatchNormBackwardDescriptor(op),
                "infiniopDestroyBatchNormBackwardDescriptor",
            )
        for desc in filter(None, descs):
            check(capi.infiniopDestroyTensorDescriptor(desc), "infiniopDestroyTensorDescriptor")
    except CallFailed as exc:
        ok, result = False, str(exc)

    layouts = [str(tuple(t.stride())) for t in (x, dy, dx)]  # all three where they differ
    layout = layouts[0] if len(set(layouts)) == 1 else "/".join(layouts)
    print(
        f"{device.name:<6} shape={case[0]!s:<15} strides={layout:<15} "
        f"dtype={dtype.name:<4} mode={_MODE_NAMES[mode]:<5} {'PASS' if ok else 'FAIL'} {result}"
    )
    for detail in details if args.debug else ():
        debug(*detail)
    if timings:
        theirs = f"{timings[1]:.4f} ms" if isinstance(timings[1], float) else timings[1]
        print(f"   time: infiniopBatchNormBackward {timings[0]:.4f} ms, torch {theirs}")
    return ok


def main() -> None:
    args = get_args()
    devices = [d for d, wanted in ((Device.CPU, args.cpu), (Device.NVIDIA, args.nvidia)) if wanted]
    passed = failed = 0
    for device in devices or [Device.CPU]:
        handle = c_void_p()
        try:
            check(capi.infinirtSetDevice(device, 0), "infinirtSetDevice")
            check(capi.infiniopCreateHandle(byref(handle)), "infiniopCreateHandle")
        except CallFailed as exc:
            print(f"{device.name:<6} FAIL {exc}")
            failed += 1
            continue
        rng = torch.Generator().manual_seed(0)
        for case in _TEST_CASES:
            for dtype in _TENSOR_DTYPES:
                if test(handle, device, case, dtype, args, rng):
                    passed += 1
                else:
                    failed += 1
        if capi.infiniopDestroyHandle(handle) != Status.SUCCESS:
            print(f"{device.name:<6} FAIL infiniopDestroyHandle: {capi.last_error()}")
            failed += 1
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
