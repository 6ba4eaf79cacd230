"""The forward passes on a real GPU, and everything the backward takes from them.

Every test is marked ``gpu`` and skipped, with the reason, where there is no usable GPU
(``tests/conftest.py``, which also lists each of them in the GPU report). Test ids end with
the engine ``cudnn_bn/backends/nvidia.py`` promises for the problem (``cudnn`` or
``cupy``), and each test asserts that the cached descriptor (``cudnn_bn.descriptor_cache``)
really chose it.

Data is made in float64, rounded to its dtype on the device by torch and laid out with the
strides under test (``helpers.py``'s), then handed over as CuPy arrays (views of
the torch memory) or as the torch tensors themselves. The reference is PyTorch on CUDA in
float64 on those same rounded values, with cuDNN switched off so that its native kernels,
not cuDNN again, are the judge: ``F.batch_norm`` for outputs and the running-statistics
update, ``aten.native_batch_norm`` for the saved mean and invstd, autograd through
``F.batch_norm`` (and ``relu``) for gradients.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    OUTPUTS,
    as_f64,
    channels_last,
    make_gpu_problem,
    on_device,
    padded_strides,
    run_gpu_problem,
)

import cudnn_bn
from cudnn_bn.api import (
    batch_norm_backward,
    batch_norm_backward_batched,
    batch_norm_forward_inference,
    batch_norm_forward_training,
)
from cudnn_bn.tensor import contiguous_strides

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
HALF = (F16, BF16)
EPS = 1e-5
MOMENTUM = 0.25  # not the default 0.1, so that the one passed is seen to be used

# atol = rtol against the float64 reference. F16/BF16: InfiniCore's 1e-2 (a few ulps of
# values of magnitude ~1; BF16 has 8 significant bits). F32: InfiniCore's 2e-5. cuDNN sums
# F32 data in F32 (the CuPy engine in double), so a per-channel sum over M values carries at
# most about sqrt(M) * 2^-24 of relative error (M <= 144 here: < 1e-6), well inside 2e-5; the inputs
# are the reference's own, so no rounding of the data enters. F64: summation order only.
TOL = {F16: 1e-2, BF16: 1e-2, F32: 2e-5, F64: 1e-9}
# cuDNN's SPATIAL_PERSISTENT kernels (channels-last 4-D/5-D training, PyTorch's choice and
# the default here) "may use a scaled atomic integer reduction" (cuDNN's documentation):
# fixed-point partial sums with an undocumented scale, not the float sums the 2e-5 bound
# assumes. F32 through them gets 1e-4: still 100x inside F16's bound and far below what a
# wrong formula or a wrong statistic gives (1e-1 and more). The same problems also run with
# persistent=False, under the plain 2e-5. F16 keeps 1e-2 either way.
PERSISTENT_F32_TOL = 1e-4
# Two results of the same computation on the same data (output masks, batched vs looped):
# only a reduction's order may differ, so allow about two ulps of the dtype compared. A mix-up
# (a gradient of the wrong problem, a masked output left unwritten) is off by O(1).
SAME_TOL = {F16: 2e-3, BF16: 8e-3, F32: 1e-6, F64: 1e-12}
# Fused tests compare gradients through the ReLU mask of an output rounded by the engine
# with autograd's mask from float64: a pre-activation this close to 0 could fall on either
# side. The seeds below keep every value further away (asserted, so a new seed cannot
# silently make a test flaky).
RELU_MARGIN = 1e-4


# --- data, conversions, references ---------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_data(shape, strides, dtype, channel_dtype, seed=0) -> dict[str, torch.Tensor]:
    """Torch CUDA tensors: data (and residual ``z``) laid out with ``strides``, per-channel
    tensors in ``channel_dtype``."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    data = {
        "input": on_device(2 * rng.standard_normal(shape) + 0.5, dtype, strides),
        "z": on_device(rng.standard_normal(shape), dtype, strides),
        "grad_output": on_device(rng.standard_normal(shape), dtype, strides),
        "weight": on_device(rng.uniform(0.5, 1.5, c), channel_dtype),
        "bias": on_device(0.5 * rng.standard_normal(c), channel_dtype),
        "running_mean": on_device(0.3 * rng.standard_normal(c), channel_dtype),
        "running_var": on_device(rng.uniform(0.5, 2.0, c), channel_dtype),
    }
    torch.cuda.synchronize()
    return data


def handed_over(kind: str, data: dict) -> dict:
    """What the array API gets: CuPy views of the torch memory, or the torch tensors."""
    if kind == "torch":
        return dict(data)
    return {name: None if t is None else cupy.asarray(t) for name, t in data.items()}


def on_host(kind: str, data: dict) -> dict:
    """Host copies for the CPU backend: torch CPU tensors, or NumPy arrays for CuPy kinds."""
    if kind == "torch":
        return {name: None if t is None else t.cpu() for name, t in data.items()}
    return {name: None if t is None else t.cpu().numpy() for name, t in data.items()}


def array_type(kind: str) -> type:
    return torch.Tensor if kind == "torch" else cupy.ndarray


def torch_dtype(array) -> torch.dtype:
    return array.dtype if isinstance(array, torch.Tensor) else getattr(torch, str(array.dtype))


def element_strides(array) -> tuple[int, ...]:
    if isinstance(array, torch.Tensor):
        return tuple(array.stride())
    return tuple(s // array.itemsize for s in array.strides)


def f64(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy (``.double()`` of a float64 tensor would alias it)."""
    return t.detach().to(torch.float64, copy=True)


def native():
    """PyTorch's own CUDA kernels for the reference, not cuDNN."""
    return torch.backends.cudnn.flags(enabled=False)


def reference_training(d: dict, momentum: float = MOMENTUM, eps: float = EPS) -> dict:
    """float64 output, saved statistics and updated running statistics of PyTorch."""
    x, w, b, rm, rv = (
        f64(d[n]) for n in ("input", "weight", "bias", "running_mean", "running_var")
    )
    with native():
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=momentum, eps=eps)
        _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.0, eps)
    return {
        "output": y,
        "saved_mean": mean,
        "saved_invstd": invstd,
        "running_mean": rm,
        "running_var": rv,
    }


def reference_inference(d: dict, eps: float = EPS) -> torch.Tensor:
    x, w, b, rm, rv = (
        f64(d[n]) for n in ("input", "weight", "bias", "running_mean", "running_var")
    )
    with native():
        return F.batch_norm(x, rm, rv, w, b, training=False, eps=eps)


def reference_autograd(d: dict, fusion: str | None = None, eps: float = EPS):
    """float64 ``(pre-activation, output, gradients by name)`` of ``act(bn(x) [+ z])``."""
    names = ("input", "weight", "bias", "z")
    leaves = {n: f64(d[n]).requires_grad_() for n in names}
    x, w, b, z = leaves.values()
    with native():
        pre = F.batch_norm(x, None, None, w, b, training=True, eps=eps)
        if fusion == "add_relu":
            pre = pre + z
        y = torch.relu(pre) if fusion else pre
        y.backward(f64(d["grad_output"]))
    grads = {f"grad_{n}": t.grad for n, t in leaves.items()}
    return pre.detach(), y.detach(), grads


def check(actual, expected, tol: float, what: str) -> None:
    np.testing.assert_allclose(as_f64(actual), as_f64(expected), rtol=tol, atol=tol, err_msg=what)


def cached_engines() -> list[str]:
    """The engines of the cached descriptors, oldest first (clear the cache before)."""
    return [desc.engine for desc in cudnn_bn.descriptor_cache.descriptors()]


# --- the problems ---------------------------------------------------------------------------

# (how arrays are handed over, data dtype, per-channel dtype); CuPy has no bfloat16.
KINDS = [
    ("cupy", F16, F32), ("cupy", F32, F32), ("cupy", F64, F64),
    ("torch", F16, F32), ("torch", BF16, F32), ("torch", BF16, BF16), ("torch", F32, F32),
]  # fmt: skip
SHAPES = [(16, 3), (4, 3, 10), (2, 3, 4, 5), (2, 3, 2, 3, 4)]


def layouts(shape):
    yield "contiguous", contiguous_strides(shape)
    if len(shape) > 2:
        yield "channels_last", channels_last(shape)
    yield "padded", padded_strides(shape)


def expected_engine(dtype: torch.dtype, layout: str, ndim: int) -> str:
    """The engine choice of ``cudnn_bn/backends/nvidia.py``: cuDNN for 3-D to 5-D
    F16/F32/F64 in one packed layout; CuPy for BF16, other strides and 2-D input (PyTorch
    sends none to cuDNN)."""
    return "cupy" if dtype == BF16 or layout == "padded" or ndim == 2 else "cudnn"


def is_persistent(shape, layout: str, persistent, engine: str) -> bool:
    """Whether cuDNN runs this training problem in SPATIAL_PERSISTENT mode."""
    return (
        engine == "cudnn" and layout == "channels_last" and len(shape) >= 4 and persistent is None
    )


def tolerance(dtype: torch.dtype, persistent_mode: bool) -> float:
    return PERSISTENT_F32_TOL if dtype == F32 and persistent_mode else TOL[dtype]


def cases(training: bool) -> list:
    """Every kind x shape x layout; channels-last 4-D/5-D training also with persistent=False."""
    params = []
    for kind, dtype, channel_dtype in KINDS:
        for shape in SHAPES:
            for layout, strides in layouts(shape):
                engine = expected_engine(dtype, layout, len(shape))
                flags = [None]
                if training and layout == "channels_last" and len(shape) >= 4:
                    flags.append(False)
                for persistent in flags:
                    label = "x".join(map(str, shape))
                    mode = "" if persistent is None else "-persistent=False"
                    ident = (
                        f"{kind}-{dtype_name(dtype)}-{dtype_name(channel_dtype)}-{label}-"
                        f"{layout}{mode}-{engine}"
                    )
                    params.append(
                        pytest.param(
                            kind,
                            dtype,
                            channel_dtype,
                            shape,
                            strides,
                            layout,
                            persistent,
                            engine,
                            id=ident,
                        )
                    )
    return params


CASE_NAMES = (
    "kind",
    "dtype",
    "channel_dtype",
    "shape",
    "strides",
    "layout",
    "persistent",
    "engine",
)


# --- training forward -----------------------------------------------------------------------


@pytest.mark.parametrize(CASE_NAMES, cases(training=True))
def test_forward_training_against_torch(
    kind, dtype, channel_dtype, shape, strides, layout, persistent, engine
):
    d = make_data(shape, strides, dtype, channel_dtype)
    want = reference_training(d)  # before the call: the running statistics change in place
    a = handed_over(kind, d)
    cudnn_bn.descriptor_cache.clear()
    got = batch_norm_forward_training(
        a["input"], a["weight"], a["bias"], a["running_mean"], a["running_var"],
        momentum=MOMENTUM, eps=EPS, persistent=persistent,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert cached_engines() == [engine]
    assert isinstance(got, tuple) and len(got) == 3
    output, saved_mean, saved_invstd = got
    assert all(isinstance(t, array_type(kind)) for t in got)
    assert torch_dtype(output) == dtype and tuple(output.shape) == shape
    if layout != "padded":  # the output keeps a packed input's layout
        assert element_strides(output) == element_strides(a["input"])
    stats_dtype = F32 if dtype in HALF else dtype
    assert torch_dtype(saved_mean) == torch_dtype(saved_invstd) == stats_dtype
    tol = tolerance(dtype, is_persistent(shape, layout, persistent, engine))
    results = {
        "output": output,
        "saved_mean": saved_mean,
        "saved_invstd": saved_invstd,
        "running_mean": d["running_mean"],
        "running_var": d["running_var"],
    }
    for name, value in results.items():
        check(value, want[name], tol, f"{name} ({engine} engine)")


def test_running_statistics_follow_momentum_over_steps():
    """Three steps on cuDNN: running = (1 - m) * running + m * batch (unbiased var) each time."""
    d = make_data((4, 3, 5, 6), None, F32, F32)
    a = handed_over("cupy", d)
    cudnn_bn.descriptor_cache.clear()
    for step in range(3):
        want = reference_training(d)
        batch_norm_forward_training(
            a["input"], a["weight"], a["bias"], a["running_mean"], a["running_var"],
            momentum=MOMENTUM, eps=EPS,
        )  # fmt: skip
        torch.cuda.synchronize()
        for name in ("running_mean", "running_var"):
            check(d[name], want[name], TOL[F32], f"{name} after step {step + 1}")
    assert cached_engines() == ["cudnn"]


# --- inference forward ----------------------------------------------------------------------


@pytest.mark.parametrize(CASE_NAMES, cases(training=False))
def test_forward_inference_against_torch(
    kind, dtype, channel_dtype, shape, strides, layout, persistent, engine
):
    d = make_data(shape, strides, dtype, channel_dtype)
    running = [d[n].clone() for n in ("running_mean", "running_var")]
    want = reference_inference(d)
    a = handed_over(kind, d)
    cudnn_bn.descriptor_cache.clear()
    output = batch_norm_forward_inference(
        a["input"], a["weight"], a["bias"], a["running_mean"], a["running_var"], eps=EPS
    )
    torch.cuda.synchronize()
    assert cached_engines() == [engine]
    assert isinstance(output, array_type(kind))
    assert torch_dtype(output) == dtype and tuple(output.shape) == shape
    if layout != "padded":
        assert element_strides(output) == element_strides(a["input"])
    check(output, want, TOL[dtype], f"output ({engine} engine)")
    for before, name in zip(running, ("running_mean", "running_var"), strict=True):
        assert torch.equal(d[name], before), f"{name} changed in inference"


# --- forward -> backward with the reserve space ----------------------------------------------


@pytest.mark.parametrize(CASE_NAMES, cases(training=True))
def test_round_trip_with_reserve_against_autograd(
    kind, dtype, channel_dtype, shape, strides, layout, persistent, engine
):
    """y, m, s = forward; backward(mode="saved", saved_mean=m, saved_invstd=s, reserve=...)."""
    d = make_data(shape, strides, dtype, channel_dtype)
    _, _, want = reference_autograd(d)
    a = handed_over(kind, d)
    cudnn_bn.descriptor_cache.clear()
    out = batch_norm_forward_training(
        a["input"], a["weight"], a["bias"], None, None, eps=EPS, persistent=persistent
    )
    if out.reserve is not None:
        assert isinstance(out.reserve, array_type(kind))
    grads = batch_norm_backward(
        a["input"], a["grad_output"], a["weight"], None, None, eps=EPS, mode="saved",
        saved_mean=out[1], saved_invstd=out[2], reserve=out.reserve, persistent=persistent,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert cached_engines() == [engine, engine]  # the forward's descriptor, the backward's
    assert len(grads) == 3
    tol = tolerance(dtype, is_persistent(shape, layout, persistent, engine))
    for name, got in zip(OUTPUTS, grads, strict=True):
        assert isinstance(got, array_type(kind))
        check(got, want[name], tol, f"{name} ({engine} engine)")


# --- fused BN + ReLU / BN + Add + ReLU ---------------------------------------------------------


def fused_case(dtype, shape, layout, engine, why):
    label = "x".join(map(str, shape))
    return pytest.param(
        dtype, shape, layout, engine, id=f"{dtype_name(dtype)}-{label}-{layout}-{engine}-{why}"
    )


FUSED_CASES = [
    fused_case(F16, (4, 8, 6, 6), "channels_last", "cudnn", "cudnn-fused-kernels"),
    fused_case(F16, (2, 8, 2, 3, 4), "channels_last", "cupy", "5-D"),
    fused_case(F16, (4, 6, 6, 6), "channels_last", "cupy", "C-not-multiple-of-4"),
    fused_case(F16, (4, 8, 6, 6), "contiguous", "cupy", "not-channels-last"),
    fused_case(F32, (4, 8, 6, 6), "channels_last", "cupy", "not-F16"),
    fused_case(F32, (2, 8, 4, 5), "contiguous", "cupy", "not-F16"),
]


@pytest.mark.parametrize("mode", ["saved", "train"])
@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
@pytest.mark.parametrize(("dtype", "shape", "layout", "engine"), FUSED_CASES)
def test_fused_round_trip_against_autograd(dtype, shape, layout, engine, fusion, mode):
    """relu(bn(x) [+ z]) forward and its backward (through the forward's output, bias and
    reserve; grad_z for add_relu) against autograd through ``relu(F.batch_norm(x) [+ z])``."""
    strides = channels_last(shape) if layout == "channels_last" else None
    d = make_data(shape, strides, dtype, F32, seed=1)
    pre, y, want = reference_autograd(d, fusion)
    margin = pre.abs().min().item()
    assert margin > RELU_MARGIN, f"a pre-activation is {margin:.1e} from the ReLU's kink"
    a = handed_over("cupy", d)
    z = a["z"] if fusion == "add_relu" else None
    cudnn_bn.descriptor_cache.clear()
    out = batch_norm_forward_training(
        a["input"], a["weight"], a["bias"], None, None, eps=EPS, fusion=fusion, z=z
    )
    check(out[0], y, TOL[dtype], f"fused forward output ({engine} engine)")
    kept = as_f64(out[0]) > 0  # the mask the backward reads
    assert (kept == (y > 0).cpu().numpy()).all(), "the ReLU kept other values than autograd's"
    assert element_strides(out[0]) == element_strides(a["input"])
    saved = dict(saved_mean=out[1], saved_invstd=out[2]) if mode == "saved" else {}
    grads = batch_norm_backward(
        a["input"], a["grad_output"], a["weight"], None, None, eps=EPS, mode=mode,
        fusion=fusion, output=out[0], bias=a["bias"], reserve=out.reserve, **saved,
    )  # fmt: skip
    torch.cuda.synchronize()
    # cuDNN's fused backward reads saved statistics: from train mode it is the CuPy engine's.
    assert cached_engines() == [engine, "cupy" if mode == "train" else engine]
    names = OUTPUTS + (("grad_z",) if fusion == "add_relu" else ())
    assert len(grads) == len(names)
    for name, got in zip(names, grads, strict=True):
        check(got, want[name], TOL[dtype], f"{name} ({engine} engine, {fusion}, {mode})")


# --- output masks and batched backward --------------------------------------------------------

MASKS = [
    (True, False, False),
    (False, True, False),
    (False, False, True),
    (False, True, True),
    (True, True, False),
]
# (shape, strides, dtype, per-channel dtype, helpers.make_gpu_problem's mode, engine)
MASK_CASES = [
    pytest.param((2, 3, 4, 5), None, F32, F32, "train", "cudnn", id="F32-train-cudnn"),
    pytest.param((4, 8, 6, 6), channels_last((4, 8, 6, 6)), F16, F32, "saved_invstd", "cudnn",
                 id="F16-channels_last-saved-persistent-cudnn"),
    pytest.param((2, 3, 4, 5), None, F32, F32, "eval", "cupy", id="F32-eval-cupy"),
    pytest.param((2, 3, 4, 5), padded_strides((2, 3, 4, 5)), BF16, F32, "train", "cupy",
                 id="BF16-padded-train-cupy"),
]  # fmt: skip


def same_tol(array) -> float:
    return SAME_TOL[torch_dtype(array)]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "".join("1" if b else "0" for b in m))
@pytest.mark.parametrize(
    ("shape", "strides", "dtype", "channel_dtype", "mode", "engine"), MASK_CASES
)
def test_output_mask_against_unmasked(shape, strides, dtype, channel_dtype, mode, engine, mask):
    p = make_gpu_problem(shape, strides, dtype, channel_dtype, mode)
    convert = (lambda t: t) if dtype == BF16 else cupy.asarray
    cudnn_bn.descriptor_cache.clear()
    full = run_gpu_problem(p, convert)
    masked = run_gpu_problem(p, convert, output_mask=mask)
    torch.cuda.synchronize()
    assert cached_engines() == [engine, engine]
    assert len(masked) == 3
    for name, wanted, got, expected in zip(OUTPUTS, mask, masked, full, strict=True):
        if not wanted:
            assert got is None, f"{name} was not asked for but came back"
        else:
            check(got, expected, same_tol(got), f"{name} with output_mask={mask} ({engine})")


def batched_problem(kind, dtype, channel_dtype, mode, per_problem, seed=2):
    """The arrays of B problems ``(B, N, C, H, W)`` by name; per-channel tensors ``(C,)``
    shared or ``(B, C)`` one row per problem (saved statistics: each problem's own)."""
    rng = np.random.default_rng(seed)
    batch, shape = 3, (2, 4, 3, 5)
    c = shape[1]
    rows = (batch, c) if per_problem else (c,)
    t = {
        "input": on_device(2 * rng.standard_normal((batch, *shape)) + 0.5, dtype),
        "grad_output": on_device(rng.standard_normal((batch, *shape)), dtype),
        "weight": on_device(rng.uniform(0.5, 1.5, rows), channel_dtype),
    }
    if mode == "eval":
        t["running_mean"] = on_device(0.3 * rng.standard_normal(rows), channel_dtype)
        t["running_var"] = on_device(rng.uniform(0.5, 2.0, rows), channel_dtype)
    elif mode == "saved":
        x = t["input"].double()
        mean, var = x.mean(dim=(1, 3, 4)), x.var(dim=(1, 3, 4), correction=0)
        stats = F32 if dtype in HALF else dtype
        t["saved_mean"], t["saved_invstd"] = mean.to(stats), torch.rsqrt(var + EPS).to(stats)
    torch.cuda.synchronize()
    return handed_over(kind, t)


def row(array, b: int):
    """Problem ``b``'s per-channel tensor: row ``b`` of a ``(B, C)`` one, a shared one as is."""
    return array[b] if array is not None and array.ndim == 2 else array


BATCHED_CASES = [
    pytest.param("cupy", F32, F32, "train", False, "cudnn", id="F32-train-shared-cudnn"),
    pytest.param("cupy", F16, F32, "saved", True, "cudnn", id="F16-saved-per-problem-cudnn"),
    pytest.param("cupy", F32, F32, "eval", True, "cupy", id="F32-eval-per-problem-cupy"),
    pytest.param("torch", BF16, F32, "saved", True, "cupy", id="BF16-saved-per-problem-cupy"),
    pytest.param("torch", BF16, BF16, "train", False, "cupy", id="BF16-train-shared-cupy"),
]


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, True)], ids=["111", "011"])
@pytest.mark.parametrize(
    ("kind", "dtype", "channel_dtype", "mode", "per_problem", "engine"), BATCHED_CASES
)
def test_batched_backward_against_a_loop(
    kind, dtype, channel_dtype, mode, per_problem, engine, mask
):
    a = batched_problem(kind, dtype, channel_dtype, mode, per_problem)
    names = ("running_mean", "running_var", "saved_mean", "saved_invstd")
    cudnn_bn.descriptor_cache.clear()
    batched = batch_norm_backward_batched(
        a["input"], a["grad_output"], a["weight"], a.get("running_mean"), a.get("running_var"),
        saved_mean=a.get("saved_mean"), saved_invstd=a.get("saved_invstd"), eps=EPS,
        mode=mode, output_mask=mask,
    )  # fmt: skip
    batch = a["input"].shape[0]
    for name, got, wanted in zip(OUTPUTS, batched, mask, strict=True):
        if not wanted:
            assert got is None, f"{name} was not asked for but came back"
        else:
            assert isinstance(got, array_type(kind))
            expected_shape = (
                a["input"].shape if name == "grad_input" else (batch, a["weight"].shape[-1])
            )
            assert tuple(got.shape) == tuple(expected_shape)
    for b in range(batch):
        stats = {n: row(a.get(n), b) for n in names}
        looped = batch_norm_backward(
            a["input"][b], a["grad_output"][b], row(a["weight"], b), stats["running_mean"],
            stats["running_var"], saved_mean=stats["saved_mean"],
            saved_invstd=stats["saved_invstd"], eps=EPS, mode=mode, output_mask=mask,
        )  # fmt: skip
        for name, got, expected in zip(OUTPUTS, batched, looped, strict=True):
            if got is not None:
                check(got[b], expected, same_tol(got), f"{name} of problem {b} ({engine})")
    torch.cuda.synchronize()
    assert cached_engines() == [engine]  # one descriptor serves every problem and the loop


# --- the CuPy engine against the CPU backend ----------------------------------------------------

AGREEMENT_CASES = [
    pytest.param("torch", BF16, BF16, (2, 3, 4, 5), "contiguous", id="BF16-BF16-contiguous"),
    pytest.param("torch", BF16, F32, (2, 4, 3, 5), "channels_last", id="BF16-F32-channels_last"),
    pytest.param("torch", BF16, F32, (4, 3, 10), "padded", id="BF16-F32-padded"),
    pytest.param("cupy", F32, F32, (2, 3, 4, 5), "padded", id="F32-padded"),
    pytest.param("cupy", F16, F32, (2, 3, 2, 3, 4), "padded", id="F16-padded-5d"),
    pytest.param("cupy", F64, F64, (13, 2, 4), (10, 4, 1), id="F64-infinicore-strides"),
]
AGREEMENT_NAMES = ("kind", "dtype", "channel_dtype", "shape", "layout")


def agreement_data(kind, dtype, channel_dtype, shape, layout) -> tuple[dict, dict, dict]:
    """``(torch CUDA tensors, what the GPU call gets, host copies for the CPU backend)``."""
    strides = layout if isinstance(layout, tuple) else dict(layouts(shape))[layout]
    d = make_data(shape, strides, dtype, channel_dtype)
    return d, handed_over(kind, d), on_host(kind, d)


@pytest.mark.parametrize("fusion", [None, "relu", "add_relu"])
@pytest.mark.parametrize(AGREEMENT_NAMES, AGREEMENT_CASES)
def test_cupy_engine_forward_training_matches_cpu(
    kind, dtype, channel_dtype, shape, layout, fusion
):
    _, gpu, cpu = agreement_data(kind, dtype, channel_dtype, shape, layout)
    results = []
    for arrays in (gpu, cpu):
        cudnn_bn.descriptor_cache.clear()
        out = batch_norm_forward_training(
            arrays["input"], arrays["weight"], arrays["bias"], arrays["running_mean"],
            arrays["running_var"], momentum=MOMENTUM, eps=EPS, fusion=fusion,
            z=arrays["z"] if fusion == "add_relu" else None,
        )  # fmt: skip
        torch.cuda.synchronize()
        assert cached_engines() == ["cupy" if arrays is gpu else "numpy"]
        results.append((*out, arrays["running_mean"], arrays["running_var"]))
    names = ("output", "saved_mean", "saved_invstd", "running_mean", "running_var")
    for name, on_gpu, on_cpu in zip(names, *results, strict=True):
        check(on_gpu, on_cpu, TOL[dtype], f"{name}: CuPy engine vs CPU backend ({fusion})")


@pytest.mark.parametrize(AGREEMENT_NAMES, AGREEMENT_CASES)
def test_cupy_engine_forward_inference_matches_cpu(kind, dtype, channel_dtype, shape, layout):
    _, gpu, cpu = agreement_data(kind, dtype, channel_dtype, shape, layout)
    names = ("input", "weight", "bias", "running_mean", "running_var")
    cudnn_bn.descriptor_cache.clear()
    on_gpu = batch_norm_forward_inference(*(gpu[n] for n in names), eps=EPS)
    torch.cuda.synchronize()
    assert cached_engines() == ["cupy"]
    on_cpu = batch_norm_forward_inference(*(cpu[n] for n in names), eps=EPS)
    check(on_gpu, on_cpu, TOL[dtype], "output: CuPy engine vs CPU backend")


@pytest.mark.parametrize(
    ("mode", "fusion"),
    [("train", None), ("saved", None), ("eval", None), ("saved", "relu"), ("train", "add_relu")],
)
@pytest.mark.parametrize(AGREEMENT_NAMES, AGREEMENT_CASES)
def test_cupy_engine_backward_matches_cpu(kind, dtype, channel_dtype, shape, layout, mode, fusion):
    """Both backends get the very same inputs: saved statistics and the fused forward's
    output come from PyTorch, rounded to their dtypes."""
    d, gpu, cpu = agreement_data(kind, dtype, channel_dtype, shape, layout)
    extra = {}
    if mode == "saved":
        with native():
            _, mean, invstd = torch.ops.aten.native_batch_norm(
                f64(d["input"]), None, None, None, None, True, 0.0, EPS
            )
        stats = F32 if dtype in HALF else dtype
        extra |= {"saved_mean": mean.to(stats), "saved_invstd": invstd.to(stats)}
    if fusion is not None:
        _, y, _ = reference_autograd(d, fusion)
        output = torch.empty_strided(y.shape, d["input"].stride(), dtype=dtype, device=y.device)
        extra |= {"output": output.copy_(y), "bias": d["bias"]}
    torch.cuda.synchronize()
    results = []
    for arrays, more in ((gpu, handed_over(kind, extra)), (cpu, on_host(kind, extra))):
        running = mode == "eval"
        cudnn_bn.descriptor_cache.clear()
        got = batch_norm_backward(
            arrays["input"], arrays["grad_output"], arrays["weight"],
            arrays["running_mean"] if running else None,
            arrays["running_var"] if running else None,
            eps=EPS, mode=mode, fusion=fusion, **more,
        )  # fmt: skip
        torch.cuda.synchronize()
        assert cached_engines() == ["cupy" if arrays is gpu else "numpy"]
        results.append(got)
    names = OUTPUTS + (("grad_z",) if fusion == "add_relu" else ())
    for name, on_gpu, on_cpu in zip(names, *results, strict=True):
        check(on_gpu, on_cpu, TOL[dtype], f"{name}: CuPy engine vs CPU backend ({mode}, {fusion})")
