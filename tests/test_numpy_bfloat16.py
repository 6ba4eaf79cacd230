"""NumPy BF16 arrays (``ml_dtypes.bfloat16``) run on the CPU backend and come back as BF16."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, reference

import cudnn_bn

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("channel_dtype", [BF16, np.dtype(np.float32)], ids=["bf16", "f32"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_backward_on_numpy_bfloat16(mode, channel_dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5)).astype(BF16)
    dy = rng.standard_normal((4, 3, 5)).astype(BF16)
    w = rng.uniform(0.5, 1.5, 3).astype(channel_dtype)
    mean, var = (
        rng.standard_normal(3).astype(channel_dtype),
        rng.uniform(0.5, 2, 3).astype(channel_dtype),
    )
    stats = (None, None) if mode == "train" else (mean, var)
    got = cudnn_bn.batch_norm_backward(x, dy, w, *stats, mode=mode)
    assert [g.dtype for g in got] == [BF16, channel_dtype, channel_dtype]
    want = reference(
        x.astype(np.float64),
        dy.astype(np.float64),
        w.astype(np.float64),
        mode=mode,
        mean=mean.astype(np.float64),
        var=var.astype(np.float64),
    )
    for actual, expected in zip(got, want, strict=True):
        assert_close(actual.astype(np.float64), expected, torch.bfloat16)


class _Subclass(np.ndarray):
    """An ndarray subclass: read through the door, like any other producer."""


class _DLPackOnly:
    """A host BF16 producer with only DLPack (ml_dtypes has no DLPack export)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__()

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


@pytest.mark.parametrize("first", ["subclass", "dlpack"])
def test_outputs_take_the_storage_of_each_calls_input_not_of_the_first(first):
    """An output follows its input: ``ml_dtypes.bfloat16`` for an ndarray of it, uint16 bits
    for a producer without it. Both producers' operands describe alike, so a plan keyed by
    that alone served the second its first caller's storage (found in review 7)."""
    x = torch.randn(4, 3, 5).to(torch.bfloat16)
    producers = {
        "subclass": (x.view(torch.int16).numpy().view(BF16).view(_Subclass), BF16),
        "dlpack": (_DLPackOnly(x), np.dtype(np.uint16)),
    }
    w, b, mean, var = (np.full(3, v, np.float32) for v in (1, 0, 0, 1))
    cudnn_bn.descriptor_cache.clear()
    for name in (first, *(n for n in producers if n != first)):
        given, storage = producers[name]
        assert cudnn_bn.batch_norm_forward_inference(given, w, b, mean, var).dtype == storage


def test_an_absent_weight_and_bias_are_one_and_zero_where_bf16_is_held_as_bits():
    """Without ml_dtypes' type to follow (a DLPack input), a host BF16 array is uint16 bits:
    the ones and zeros standing in for ``weight=None``/``bias=None`` beside BF16 statistics
    must be those values' bits, not the integers 1 and 0 (found in review 7)."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5).to(torch.bfloat16)
    mean, var = torch.randn(3).to(torch.bfloat16), torch.rand(3).to(torch.bfloat16) + 0.5
    given = (_DLPackOnly(t) for t in (x, mean, var))
    cudnn_bn.descriptor_cache.clear()
    got = cudnn_bn.batch_norm_forward_inference(next(given), None, None, *given)
    want = F.batch_norm(x.double(), mean.double(), var.double(), training=False, eps=1e-5)
    assert got.dtype == np.uint16
    assert_close(torch.from_numpy(got.view(np.int16)).view(torch.bfloat16), want, torch.bfloat16)
