"""The NumPy backend against references it did not write: PyTorch's CPU batch-norm backward
in float64, and central finite differences of PyTorch's batch-norm forward.

Inputs are made in float64, rounded to the tensor's dtype by torch, and laid out in memory
with the strides under test; the references see those rounded values in float64, so the only
error the backend may add is the final rounding of each output.
"""

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from helpers import SHAPES, channels_last, padded_strides

from cudnn_bn.backends.cpu import BatchNormBackward
from cudnn_bn.backends.host import host_array
from cudnn_bn.dtypes import FLOAT_TYPES
from cudnn_bn.enums import DataType
from cudnn_bn.problems import BackwardAttributes, BackwardPointers, BackwardTensors, Mode
from cudnn_bn.tensor import TensorDesc, contiguous_strides

F16, BF16, F32, F64 = DataType.F16, DataType.BF16, DataType.F32, DataType.F64
TORCH = {F16: torch.float16, BF16: torch.bfloat16, F32: torch.float32, F64: torch.float64}

# InfiniCore's own batch-norm tests use atol = rtol = 1e-2 for F16/BF16 and 2e-5 for F32 (we
# never go above those). Here the reference is float64 on the same rounded inputs, so our only
# error is one rounding of each output: 2**-11 (F16), 2**-8 (BF16), 2**-24 (F32) relative,
# well inside. F64 is float64 against float64 with a different summation order.
TOL = {F16: 1e-2, BF16: 1e-2, F32: 2e-5, F64: 1e-10}

# (input dtype, per-channel dtype): the same dtype, or F32 statistics for half input.
DTYPES = [(F16, F16), (F16, F32), (BF16, BF16), (BF16, F32), (F32, F32), (F64, F64)]
MODES = list(Mode)
SENTINEL = 0xA5  # every byte of every buffer before the run; gaps must keep it


# --- memory ------------------------------------------------------------------------------


LAYOUTS = {
    "contiguous": contiguous_strides,
    "padded": padded_strides,
    "channels_last": channels_last,
}


def strides_of(layout, shape):
    """A layout is a name in LAYOUTS or explicit strides."""
    return LAYOUTS[layout](shape) if isinstance(layout, str) else tuple(layout)


@dataclass
class Buffer:
    """A tensor laid out with given strides inside a flat buffer that also holds the gaps."""

    desc: TensorDesc
    flat: np.ndarray  # the whole allocation, storage dtype
    view: np.ndarray  # the tensor's elements, a strided view of ``flat``

    @classmethod
    def empty(cls, dtype, shape, strides):
        storage = FLOAT_TYPES[dtype].storage
        size = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        flat = np.empty(size, dtype=storage)
        flat.view(np.uint8).fill(SENTINEL)
        view = np.lib.stride_tricks.as_strided(
            flat, shape, tuple(s * storage.itemsize for s in strides), writeable=True
        )
        return cls(TensorDesc(dtype, tuple(shape), tuple(strides)), flat, view)

    @property
    def ptr(self) -> int:
        return self.flat.ctypes.data

    def gaps_untouched(self) -> bool:
        """Whether every byte outside the tensor's elements still holds SENTINEL."""
        covered = np.zeros(self.flat.shape, dtype=bool)  # itemsize 1: strides in elements
        elements = tuple(s // self.flat.itemsize for s in self.view.strides)
        np.lib.stride_tricks.as_strided(covered, self.view.shape, elements, writeable=True)[...] = 1
        return bool((self.flat[~covered].view(np.uint8) == SENTINEL).all())

    def values(self) -> torch.Tensor:
        """The tensor's values in float64, read back by torch."""
        data = torch.from_numpy(self.view.copy())
        if self.desc.dtype is BF16:
            data = data.view(torch.int16).view(torch.bfloat16)
        return data.to(torch.float64)


def rounded(values, dtype) -> torch.Tensor:
    """float64 ``values`` rounded to ``dtype`` by torch, back in float64."""
    return torch.as_tensor(values, dtype=torch.float64).to(TORCH[dtype]).to(torch.float64)


def filled(values, dtype, strides) -> Buffer:
    """A buffer of ``dtype`` holding ``values`` (rounded by torch) with ``strides``."""
    buf = Buffer.empty(dtype, tuple(values.shape), strides)
    data = torch.as_tensor(values, dtype=torch.float64).to(TORCH[dtype])
    if dtype is BF16:
        data = data.view(torch.int16)
    buf.view[...] = data.numpy().view(buf.flat.dtype)
    return buf


@dataclass
class Case:
    """Everything one backend run needs, plus the rounded inputs for the references."""

    x: torch.Tensor
    dy: torch.Tensor
    w: torch.Tensor
    stat0: torch.Tensor | None  # what running_mean holds, rounded
    stat1: torch.Tensor | None  # what running_var holds, rounded
    inputs: dict[str, Buffer]
    outputs: dict[str, Buffer]

    def interface(self) -> tuple[BackwardTensors, BackwardPointers]:
        """The descriptors and pointers; absent running_* are None and 0."""
        b = {**self.inputs, **self.outputs}
        names = BackwardTensors._fields
        return (
            BackwardTensors(*(b[n].desc if n in b else None for n in names)),
            BackwardPointers(*(b[n].ptr if n in b else 0 for n in names)),
        )

    def run(self, mode, eps):
        """Run the backend; check inputs and gaps untouched; return the outputs in float64."""
        tensors, ptrs = self.interface()
        before = {n: buf.flat.copy() for n, buf in self.inputs.items()}
        BatchNormBackward(tensors, BackwardAttributes(eps=eps, mode=mode)).run(ptrs, 0, 0)
        for n, buf in self.inputs.items():
            assert np.array_equal(buf.flat.view(np.uint8), before[n].view(np.uint8)), n
        for n, buf in self.outputs.items():
            assert buf.gaps_untouched(), f"{n}: padding written"
        return tuple(self.outputs[n].values() for n in ("grad_input", "grad_weight", "grad_bias"))


def make_case(x, dy, w, stats, dtype, pc_dtype, layouts=("contiguous",) * 3, pc_stride=1):
    """Lay out ``x``, ``dy`` (layouts[0], [1]), grad_input (layouts[2]) and the per-channel
    tensors (stride ``pc_stride``); ``stats`` is (running_mean, running_var) or None."""
    shape, c = x.shape, x.shape[1]
    x_buf = filled(x, dtype, strides_of(layouts[0], shape))
    dy_buf = filled(dy, dtype, strides_of(layouts[1], shape))
    pc = (pc_stride,)
    inputs = {"input": x_buf, "grad_output": dy_buf, "weight": filled(w, pc_dtype, pc)}
    if stats is not None:
        inputs["running_mean"] = filled(stats[0], pc_dtype, pc)
        inputs["running_var"] = filled(stats[1], pc_dtype, pc)
    outputs = {
        "grad_input": Buffer.empty(dtype, shape, strides_of(layouts[2], shape)),
        "grad_weight": Buffer.empty(pc_dtype, (c,), pc),
        "grad_bias": Buffer.empty(pc_dtype, (c,), pc),
    }
    return Case(
        inputs["input"].values(),
        inputs["grad_output"].values(),
        inputs["weight"].values(),
        inputs["running_mean"].values() if stats is not None else None,
        inputs["running_var"].values() if stats is not None else None,
        inputs,
        outputs,
    )


# --- data and references -----------------------------------------------------------------


def random_data(shape, seed):
    """x with a different mean and spread per channel, dy, weight with both signs."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    per_channel = (1, c) + (1,) * (len(shape) - 2)
    x = rng.normal(size=shape) * rng.uniform(0.5, 2, c).reshape(per_channel)
    x += rng.uniform(-2, 2, c).reshape(per_channel)
    dy = rng.normal(size=shape)
    w = rng.uniform(0.5, 1.5, c) * rng.choice([-1.0, 1.0], c)
    return x, dy, w


def batch_stats(x: torch.Tensor):
    """Batch mean and biased variance per channel, in float64."""
    axes = [0, *range(2, x.dim())]
    return x.mean(axes), x.var(axes, unbiased=False)


def mode_case(mode, shape, dtype, pc_dtype, seed=0, **layout):
    """A case whose running_* hold what ``mode`` reads (None in TRAIN)."""
    x, dy, w = random_data(shape, seed)
    xr = rounded(x, dtype)  # the statistics of the values the backend will see
    mean, var = batch_stats(xr)
    eps = 1e-5
    stats = {
        Mode.TRAIN: None,
        Mode.SAVED: (mean, var),
        Mode.SAVED_INVSTD: (mean, 1 / torch.sqrt(var + eps)),
        Mode.EVAL: (
            torch.as_tensor(np.random.default_rng(seed + 1).uniform(-1, 1, shape[1])),
            torch.as_tensor(np.random.default_rng(seed + 2).uniform(0.5, 2, shape[1])),
        ),
    }[mode]
    return make_case(x, dy, w, stats, dtype, pc_dtype, **layout)


def torch_reference(case: Case, mode, eps):
    """aten's CPU batch-norm backward in float64 on the case's rounded inputs."""
    x, dy, w = case.x, case.dy, case.w
    if mode is Mode.EVAL:
        args = (case.stat0, case.stat1, None, None, False)
    elif mode is Mode.TRAIN:
        bias = torch.zeros_like(w)
        _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
            x, w, bias, None, None, True, 0.1, eps
        )
        args = (None, None, save_mean, save_invstd, True)
    elif mode is Mode.SAVED:
        args = (None, None, case.stat0, 1 / torch.sqrt(case.stat1 + eps), True)
    else:
        args = (None, None, case.stat0, case.stat1, True)
    return torch.ops.aten.native_batch_norm_backward(dy, x, w, *args, eps, [True, True, True])


def assert_close(got, want, dtype, pc_dtype):
    for name, g, r, dt in zip(
        ("grad_input", "grad_weight", "grad_bias"),
        got,
        want,
        (dtype, pc_dtype, pc_dtype),
        strict=True,
    ):
        torch.testing.assert_close(
            g, r, atol=TOL[dt], rtol=TOL[dt], msg=lambda m, n=name: f"{n}: {m}"
        )


def check_against_torch(case, mode, eps, dtype, pc_dtype):
    got = case.run(mode, eps)
    assert_close(got, torch_reference(case, mode, eps), dtype, pc_dtype)


# --- against PyTorch -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(("dtype", "pc_dtype"), DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    ("layouts", "pc_stride"),
    [
        (("contiguous",) * 3, 1),
        (("padded",) * 3, 2),
        (("channels_last",) * 3, 3),
        (("contiguous", "channels_last", "padded"), 2),  # each big tensor its own layout
    ],
    ids=["contiguous", "padded", "channels_last", "mixed"],
)
def test_matches_torch(mode, dtype, pc_dtype, shape, layouts, pc_stride):
    case = mode_case(mode, shape, dtype, pc_dtype, layouts=layouts, pc_stride=pc_stride)
    check_against_torch(case, mode, 1e-5, dtype, pc_dtype)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(("dtype", "pc_dtype"), DTYPES, ids=lambda d: d.name)
def test_infinicore_padded_strides(mode, dtype, pc_dtype):
    """InfiniCore's own test case: shape (13, 2, 4) with strides (10, 4, 1)."""
    case = mode_case(mode, (13, 2, 4), dtype, pc_dtype, layouts=[(10, 4, 1)] * 3)
    assert case.outputs["grad_input"].flat.size == 12 * 10 + 8
    check_against_torch(case, mode, 1e-5, dtype, pc_dtype)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(
    "shape",
    [(1, 3, 5), (4, 3, 1), (4, 1, 5), (1, 2, 1), (1, 1, 1, 1), (5, 1), (1, 4), (1, 2, 3, 1, 2)],
    ids=str,
)
@pytest.mark.parametrize(("dtype", "pc_dtype"), [(F32, F32), (F64, F64)], ids=lambda d: d.name)
def test_degenerate_sizes(mode, shape, dtype, pc_dtype):
    """N = 1, L = 1, C = 1, and one value per channel (zero variance, eps keeps it finite)."""
    case = mode_case(mode, shape, dtype, pc_dtype, layouts=("padded",) * 3, pc_stride=2)
    check_against_torch(case, mode, 1e-5, dtype, pc_dtype)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_eps_zero(mode, shape):
    x, dy, w = random_data(shape, 3)
    mean, var = batch_stats(torch.as_tensor(x))
    stats = {
        Mode.TRAIN: None,
        Mode.SAVED: (mean, var),
        Mode.SAVED_INVSTD: (mean, var**-0.5),
        Mode.EVAL: (mean + 0.25, var * 2),
    }[mode]
    case = make_case(x, dy, w, stats, F64, F64, layouts=("channels_last",) * 3)
    check_against_torch(case, mode, 0.0, F64, F64)


@pytest.mark.parametrize("mode", [Mode.TRAIN, Mode.SAVED], ids=lambda m: m.name)
def test_eps_zero_constant_channel(mode):
    """Zero variance and eps 0, quietly: TRAIN's batch statistics have torch's invstd 0
    (``InvStd``), so grad_input and grad_weight are 0; SAVED's given variance has
    ``1/sqrt(var + eps)``, inf, and the formula's NaN, as torch's eval transform gives."""
    x, dy, w = random_data((4, 2, 3), 4)
    x[:, 1] = 0.75
    mean, var = batch_stats(torch.as_tensor(x))
    case = make_case(x, dy, w, None if mode is Mode.TRAIN else (mean, var), F32, F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gi, gw, gb = case.run(mode, 0.0)
    want = torch_reference(case, Mode.TRAIN, 1e-5)  # channel 0 is an ordinary channel
    torch.testing.assert_close(gi[:, 0], want[0][:, 0], atol=2e-5, rtol=2e-5)
    if mode is Mode.TRAIN:
        assert (gi[:, 1] == 0).all() and gw[1] == 0
    else:
        assert gi[:, 1].isnan().all() and gw[1].isnan()
    torch.testing.assert_close(gb, case.dy.sum((0, 2)), atol=2e-5, rtol=2e-5)


def test_train_reads_no_running_statistics():
    """TRAIN needs no running_* at all: None descriptors and null pointers."""
    case = mode_case(Mode.TRAIN, (3, 4, 5), F32, F32)
    assert "running_mean" not in case.inputs
    check_against_torch(case, Mode.TRAIN, 1e-5, F32, F32)


def test_grad_input_may_overwrite_grad_output():
    """Everything is computed before anything is written, so in-place is safe."""
    case = mode_case(Mode.TRAIN, (3, 2, 5), F64, F64)
    want = torch_reference(case, Mode.TRAIN, 1e-5)
    tensors, ptrs = case.interface()
    dy = case.inputs["grad_output"]
    tensors, ptrs = tensors._replace(grad_input=dy.desc), ptrs._replace(grad_input=dy.ptr)
    BatchNormBackward(tensors, BackwardAttributes(eps=1e-5)).run(ptrs, 0, 0)
    got = (dy.values(), case.outputs["grad_weight"].values(), case.outputs["grad_bias"].values())
    assert_close(got, want, F64, F64)


def test_descriptor_attributes():
    case = mode_case(Mode.TRAIN, (2, 3), F32, F32)
    op = BatchNormBackward(case.interface()[0], BackwardAttributes(eps=0.0))
    assert (op.engine, op.workspace_size, op.reserve_size) == ("numpy", 0, 0)


# --- against finite differences ------------------------------------------------------------


def forward(x, w, b, mode, stats, eps):
    """PyTorch's batch-norm forward: batch statistics, or the fixed ``stats`` in EVAL."""
    if mode is Mode.EVAL:
        return torch.ops.aten.native_batch_norm(x, w, b, *stats, False, 0.0, eps)[0]
    return torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.0, eps)[0]


def finite_difference(f, t, h=1e-6):
    """Central differences of the scalar ``f()`` with respect to every element of ``t``."""
    grad = torch.empty_like(t)
    flat, gflat = t.view(-1), grad.view(-1)
    for i in range(flat.numel()):
        orig = flat[i].item()
        flat[i] = orig + h
        up = f()
        flat[i] = orig - h
        down = f()
        flat[i] = orig
        gflat[i] = (up - down) / (2 * h)
    return grad


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("shape", [(5, 2), (3, 2, 4), (2, 3, 2, 2), (2, 2, 1, 2, 2)], ids=str)
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_matches_finite_differences(mode, shape, eps):
    """d/d(x, w, b) of sum(dy * y): y the training forward (TRAIN, and SAVED/SAVED_INVSTD given
    the exact batch statistics), or the inference forward with fixed statistics (EVAL)."""
    x, dy, w = random_data(shape, 7)
    x, dy, w = (torch.as_tensor(a) for a in (x, dy, w))
    b = torch.linspace(-0.5, 0.5, shape[1], dtype=torch.float64)
    mean, var = batch_stats(x)
    eval_stats = (mean + 0.3, var * 1.5 + 0.1)
    stats = {
        Mode.TRAIN: None,
        Mode.SAVED: (mean, var),
        Mode.SAVED_INVSTD: (mean, 1 / torch.sqrt(var + eps)),
        Mode.EVAL: eval_stats,
    }[mode]
    case = make_case(x.numpy(), dy.numpy(), w.numpy(), stats, F64, F64)
    got = case.run(mode, eps)

    def loss():
        return float((dy * forward(x, w, b, mode, eval_stats, eps)).sum())

    want = [finite_difference(loss, t) for t in (x, w, b)]
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)


# --- host memory and BF16 ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=lambda d: d.name)
def test_host_array_is_a_writable_view(dtype):
    buf = Buffer.empty(dtype, (13, 2, 4), (10, 4, 1))
    view = host_array(buf.ptr, buf.desc)
    assert view.shape == (13, 2, 4) and view.dtype == buf.flat.dtype
    assert view.strides == buf.view.strides and view.ctypes.data == buf.ptr
    view[...] = filled(np.full(view.shape, 1.5), dtype, (8, 4, 1)).view
    np.testing.assert_array_equal(buf.values().numpy(), np.full((13, 2, 4), 1.5))
    assert buf.gaps_untouched()


def test_bf16_reads_every_bit_pattern_as_torch():
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    got = bf16_bits_to_f32(bits)
    np.testing.assert_array_equal(
        got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)]
    )
    assert np.array_equal(np.isnan(got), np.isnan(want))


def test_bf16_rounds_as_torch():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 1 << 16, 1000, dtype=np.uint32) << 16) | 0x8000  # exact halves
    special = np.array(
        [
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x7F800000,
            0x7F800001,
            0xFFFFFFFF,
            0x00000001,
            0x80000000,
            0x7FFF8000,
        ],
        dtype=np.uint32,
    )
    values = np.concatenate([bits, ties, special]).view(np.float32)
    got = f32_to_bf16_bits(values)
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(bf16_bits_to_f32(got[nan])).all()
