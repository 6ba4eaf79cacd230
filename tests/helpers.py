"""Shared by test_api.py and test_capi.py: PyTorch's batch-norm backward as the reference.

The reference is ``torch.ops.aten.native_batch_norm_backward`` in float64 on the values the
operator saw (inputs already rounded to their dtype), compared within InfiniCore's own
tolerances: atol = rtol = 2e-5 for F32, 1e-2 for F16/BF16.
"""

import numpy as np
import torch

TOL = {
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
    torch.float32: 2e-5,
    torch.float64: 1e-10,
    np.dtype(np.float16): 1e-2,
    np.dtype(np.float32): 2e-5,
    np.dtype(np.float64): 1e-10,
}


def f64(array) -> torch.Tensor:
    """A float64 torch copy of a NumPy array or torch tensor (any float dtype)."""
    if isinstance(array, torch.Tensor):
        return array.detach().to(torch.float64)
    return torch.from_numpy(np.array(array, dtype=np.float64))


def reference(x, dy, w, *, mode="train", eps=1e-5, mean=None, var=None, invstd=None):
    """``(grad_input, grad_weight, grad_bias)`` in float64 from PyTorch.

    mode "train": batch statistics of ``x``; "saved": ``mean`` with ``var`` (biased batch
    variance) or ``invstd`` as saved by the forward; "eval": ``mean``/``var`` as running stats.
    """
    x, dy, w = f64(x), f64(dy), f64(w)
    mean = None if mean is None else f64(mean)
    mask = [True, True, True]
    if mode == "eval":
        return torch.ops.aten.native_batch_norm_backward(
            dy, x, w, mean, f64(var), None, None, False, eps, mask
        )
    if mode == "train":
        _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, None, None, None, True, 0.0, eps)
    elif invstd is None:
        invstd = 1.0 / torch.sqrt(f64(var) + eps)
    return torch.ops.aten.native_batch_norm_backward(
        dy, x, w, None, None, mean, f64(invstd), True, eps, mask
    )


def assert_close(actual, expected: torch.Tensor, dtype) -> None:
    """``actual`` (NumPy or torch, any float dtype) within ``TOL[dtype]`` of ``expected``."""
    tol = TOL[dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)]
    torch.testing.assert_close(f64(actual), expected, atol=tol, rtol=tol)
