"""NumPy BF16 arrays (``ml_dtypes.bfloat16``) run on the CPU backend and come back as BF16."""

import numpy as np
import pytest
import torch
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
