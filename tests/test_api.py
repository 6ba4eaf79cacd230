"""The array API on the CPU: ``cudnn_bn.batch_norm_backward`` over NumPy arrays and torch CPU
tensors against PyTorch's ``native_batch_norm_backward`` in float64, output kinds and layouts,
and the descriptor cache.

Inputs are drawn in float64 and rounded to the dtype under test; the reference sees the
rounded values in float64 (``helpers.reference``).
"""

import numpy as np
import pytest
import torch
from helpers import SHAPES, assert_close, f64, random_values, reference

import cudnn_bn
from cudnn_bn.descriptor_cache import DescriptorCache

EPS = 1e-5
MODES = ["train", "saved", "eval"]
# (data dtype, per-channel dtype): one dtype for all, or F32 statistics for half data.
NUMPY_DTYPES = [
    (np.float16, np.float16),
    (np.float16, np.float32),
    (np.float32, np.float32),
    (np.float64, np.float64),
]
TORCH_DTYPES = [
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
]


def problem(shape, seed=0):
    """float64 input, grad_output, weight and positive per-channel statistics."""
    return tuple(random_values(shape, seed).values())


def batch_stats(x) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and biased variance of a float64 array."""
    axes = (0, *range(2, x.ndim))
    return x.mean(axis=axes), x.var(axis=axes)


def as_numpy(values, data, channel):
    x, dy, w, rm, rv = values
    return (
        x.astype(data),
        dy.astype(data),
        w.astype(channel),
        rm.astype(channel),
        rv.astype(channel),
    )


def as_torch(values, data, channel):
    x, dy, w, rm, rv = (torch.from_numpy(v) for v in values)
    return x.to(data), dy.to(data), w.to(channel), rm.to(channel), rv.to(channel)


def check(results, expected, data, channel, like):
    """Each result is of ``like``'s kind, in its dtype, and close to the reference."""
    for got, want, dtype in zip(results, expected, (data, channel, channel), strict=True):
        assert type(got) is type(like)
        assert got.dtype == dtype
        assert tuple(got.shape) == tuple(want.shape)
        assert_close(got, want, data)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), NUMPY_DTYPES, ids=str)
def test_numpy_against_torch(data, channel, shape, mode):
    x, dy, w, rm, rv = as_numpy(problem(shape), data, channel)
    results = cudnn_bn.batch_norm_backward(x, dy, w, rm, rv, eps=EPS, mode=mode)
    expected = reference(x, dy, w, mode=mode, eps=EPS, mean=rm, var=rv)
    check(results, expected, np.dtype(data), np.dtype(channel), x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=str)
@pytest.mark.parametrize(("data", "channel"), TORCH_DTYPES, ids=str)
def test_torch_against_torch(data, channel, shape, mode):
    x, dy, w, rm, rv = as_torch(problem(shape), data, channel)
    results = cudnn_bn.batch_norm_backward(x, dy, w, rm, rv, eps=EPS, mode=mode)
    expected = reference(x, dy, w, mode=mode, eps=EPS, mean=rm, var=rv)
    check(results, expected, data, channel, x)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_saved_running_stats_are_the_batch_mean_and_biased_variance(shape, kind):
    """The spec's reading: running_mean/var given as the batch statistics reproduce train."""
    values = problem(shape)
    mean, var = batch_stats(values[0])
    make = as_numpy if kind == "numpy" else as_torch
    dtype = np.float32 if kind == "numpy" else torch.float32
    x, dy, w, _, _ = make(values, dtype, dtype)
    _, _, _, rm, rv = make((*values[:3], mean, var), dtype, dtype)
    saved = cudnn_bn.batch_norm_backward(x, dy, w, rm, rv, eps=EPS, mode="saved")
    train = reference(x, dy, w, mode="train", eps=EPS)
    check(saved, train, dtype, dtype, x)


@pytest.mark.parametrize(
    ("data", "channel"), [*TORCH_DTYPES, (torch.float64, torch.float64)], ids=str
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_saved_mean_and_invstd_from_the_forward(shape, data, channel):
    """What ``native_batch_norm`` (training) saved goes straight into the backward."""
    x, dy, w, _, _ = as_torch(problem(shape), data, channel)
    _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
        x, w.to(data), None, None, None, True, 0.1, EPS
    )
    results = cudnn_bn.batch_norm_backward(
        x, dy, w, None, None, eps=EPS, mode="saved", saved_mean=save_mean, saved_invstd=save_invstd
    )
    expected = reference(x, dy, w, mode="saved", mean=save_mean, invstd=save_invstd)
    check(results, expected, data, channel, x)
    assert_close(results[0], reference(x, dy, w, mode="train", eps=EPS)[0], data)


def test_saved_invstd_is_used_as_given():
    """No recomputation from eps: an invstd saved with another eps gives that eps's result."""
    x, dy, w, _, _ = problem((4, 3, 5))
    mean, var = batch_stats(x)
    invstd = 1 / np.sqrt(var + 0.5)
    results = cudnn_bn.batch_norm_backward(
        x, dy, w, None, None, eps=EPS, mode="saved", saved_mean=mean, saved_invstd=invstd
    )
    check(results, reference(x, dy, w, mode="train", eps=0.5), np.float64, np.float64, x)


def test_train_ignores_running_statistics():
    """InfiniCore's official generator: random running stats, eps 1e-5, batch statistics
    expected. Mode "train" gives the same result whatever the running stats are."""
    x, dy, w, rm, rv = as_numpy(problem((4, 3, 7)), np.float32, np.float32)
    rng = np.random.default_rng(7)
    other_rm = rng.standard_normal(3).astype(np.float32) * 10
    other_rv = rng.uniform(0.1, 10, 3).astype(np.float32)
    first = cudnn_bn.batch_norm_backward(x, dy, w, rm, rv, eps=1e-5)
    second = cudnn_bn.batch_norm_backward(x, dy, w, other_rm, other_rv, eps=1e-5)
    without = cudnn_bn.batch_norm_backward(x, dy, w, None, None, eps=1e-5)
    for a, b, c in zip(first, second, without, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    check(first, reference(x, dy, w, mode="train", eps=1e-5), np.float32, np.float32, x)
    eval_result = cudnn_bn.batch_norm_backward(x, dy, w, rm, rv, eps=1e-5, mode="eval")
    assert not np.allclose(eval_result[0], first[0])  # the running stats do matter there


def test_eps_zero():
    x, dy, w, _, _ = problem((3, 2, 6))
    results = cudnn_bn.batch_norm_backward(x, dy, w, None, None, eps=0)
    check(results, reference(x, dy, w, mode="train", eps=0.0), np.float64, np.float64, x)


# --- output layout -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_channels_last_input_gives_channels_last_grad_input(shape):
    """NLC / NHWC / NDHWC input: grad_input comes back in the same memory order."""
    values = problem(shape)
    x = torch.from_numpy(values[0]).float().movedim(1, -1).contiguous().movedim(-1, 1)
    assert x.stride()[1] == 1 and not x.is_contiguous()
    dy, w = torch.from_numpy(values[1]).float(), torch.from_numpy(values[2]).float()
    grad_input, grad_weight, grad_bias = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    assert grad_input.stride() == x.stride()
    assert grad_weight.stride() == grad_bias.stride() == (1,)
    assert_close(grad_input, reference(x, dy, w)[0], torch.float32)

    xn = np.moveaxis(np.moveaxis(values[0], 1, -1).astype(np.float32), -1, 1)
    dyn, wn = values[1].astype(np.float32), values[2].astype(np.float32)
    gn = cudnn_bn.batch_norm_backward(xn, dyn, wn, None, None)[0]
    assert gn.strides == xn.strides
    assert_close(gn, reference(xn, dyn, wn)[0], np.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_non_packed_input_gives_contiguous_grad_input(shape):
    x, dy, w, _, _ = as_numpy(problem(shape), np.float32, np.float32)
    wide = np.zeros((*shape[:-1], shape[-1] * 2), np.float32)
    wide[..., ::2] = x
    x = wide[..., ::2]  # every other element of the last axis
    assert not x.flags.c_contiguous
    grad_input, _, _ = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    assert grad_input.flags.c_contiguous
    assert_close(grad_input, reference(x, dy, w)[0], np.float32)

    xt = torch.from_numpy(wide)[..., ::2]
    gt = cudnn_bn.batch_norm_backward(xt, torch.from_numpy(dy), torch.from_numpy(w), None, None)[0]
    assert gt.is_contiguous()
    assert_close(gt, f64(grad_input), torch.float32)


def test_inputs_are_not_modified():
    x, dy, w, rm, rv = as_numpy(problem((2, 3, 4)), np.float32, np.float32)
    copies = [a.copy() for a in (x, dy, w, rm, rv)]
    for mode in MODES:
        cudnn_bn.batch_norm_backward(x, dy, w, rm, rv, mode=mode)
    for a, b in zip((x, dy, w, rm, rv), copies, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mixed_numpy_and_torch_cpu_arrays():
    """NumPy and torch CPU arrays live on one device: accepted; results are input's kind."""
    x, dy, w, _, _ = problem((2, 3, 4))
    results = cudnn_bn.batch_norm_backward(x, torch.from_numpy(dy), w, None, None)
    check(results, reference(x, dy, w), np.float64, np.float64, x)


# --- the descriptor cache ----------------------------------------------------------------------


def test_repeated_calls_reuse_the_cached_descriptor():
    cache = cudnn_bn.descriptor_cache
    cache.clear()
    x, dy, w, rm, rv = as_numpy(problem((2, 3, 4)), np.float32, np.float32)
    cudnn_bn.batch_norm_backward(x, dy, w, rm, rv)
    (desc,) = cache._entries.values()
    for _ in range(3):
        cudnn_bn.batch_norm_backward(x, dy, w, rm, rv)
    assert len(cache) == 1 and next(iter(cache._entries.values())) is desc

    x5, dy5 = np.zeros((2, 3, 5), np.float32), np.ones((2, 3, 5), np.float32)
    x5[:, :, 0] = 1
    new_problems = [
        dict(eps=1e-3),
        dict(mode="eval"),
        dict(mode="saved"),
        dict(x=x5, dy=dy5),  # shape
        dict(x=np.asfortranarray(x), dy=dy),  # strides
        dict(
            x=x.astype(np.float64),
            dy=dy.astype(np.float64),
            w=w.astype(np.float64),
            rm=rm.astype(np.float64),
            rv=rv.astype(np.float64),
        ),  # dtype
        dict(rm=None, rv=None),  # no running statistics
    ]
    for count, change in enumerate(new_problems, start=2):
        args = {"x": x, "dy": dy, "w": w, "rm": rm, "rv": rv, "eps": 1e-5, "mode": "train"}
        args.update(change)
        for _ in range(2):
            cudnn_bn.batch_norm_backward(
                args["x"],
                args["dy"],
                args["w"],
                args["rm"],
                args["rv"],
                eps=args["eps"],
                mode=args["mode"],
            )
        assert len(cache) == count, change
    cudnn_bn.batch_norm_backward(x, dy, w, rm, rv)  # the first problem again
    assert len(cache) == len(new_problems) + 1
    cache.clear()
    assert len(cache) == 0


class FakeDescriptor:
    def __init__(self, name: str, closed: list[str]) -> None:
        self.name, self.closed = name, closed

    def __exit__(self, *exc_info: object) -> None:
        self.closed.append(self.name)


class FakePlan:
    def __init__(self, name: str, closed: list[str]) -> None:
        self.descriptor = FakeDescriptor(name, closed)


def test_descriptor_cache_evicts_the_entry_unused_longest_and_closes_it():
    """CLOCK: an entry used since the last eviction outlives one that was not; an evicted
    entry closes once nothing holds it, the entry just added is never the one evicted."""
    closed: list[str] = []
    cache = DescriptorCache(capacity=2)
    built: list[str] = []

    def get(key: str) -> FakePlan:
        found = cache.get(key)
        if found is None:
            built.append(key)
            found = cache.add(key, FakePlan(key, closed))
        return found

    a = get("a")
    get("b")
    assert get("a") is a  # a hit; "b" is unused since it was added
    del a
    get("c")
    assert closed == ["b"] and len(cache) == 2
    held = get("c")  # "c" used, "a" not since its second chance
    get("b")  # built again; "a" goes
    assert closed == ["b", "a"]
    assert get("c") is held and built == ["a", "b", "c", "b"]
    cache.clear()
    assert closed == ["b", "a", "b"]  # "c" is still held
    del held
    assert closed == ["b", "a", "b", "c"] and len(cache) == 0


def test_a_descriptor_cache_of_capacity_zero_keeps_only_the_entry_just_added(monkeypatch):
    """Eviction never drops the entry just added: with ``capacity=0`` it found none other to
    drop and every call failed with INTERNAL_ERROR (StopIteration; found in review 7)."""
    cache = DescriptorCache(capacity=0)
    monkeypatch.setattr(cudnn_bn.api.call, "descriptor_cache", cache)
    x, dy, w, _, _ = problem((2, 3, 4))
    for eps in (1e-5, 0.1, 1e-5):
        results = cudnn_bn.batch_norm_backward(x, dy, w, None, None, eps=eps)
        check(results, reference(x, dy, w, eps=eps), np.float64, np.float64, x)
        assert len(cache) == 1


def test_descriptor_cache_evicts_real_descriptors(monkeypatch):
    """An evicted ``BatchNormBackwardDescriptor`` is closed; the next call rebuilds it."""
    cache = DescriptorCache(capacity=1)
    monkeypatch.setattr(cudnn_bn.api.call, "descriptor_cache", cache)
    x, dy, w, _, _ = problem((2, 3, 4))
    cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    (first,) = cache.descriptors()
    cudnn_bn.batch_norm_backward(x, dy, w, None, None, eps=0.1)
    assert len(cache) == 1 and first._kernel is None  # closed
    results = cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    check(results, reference(x, dy, w), np.float64, np.float64, x)
