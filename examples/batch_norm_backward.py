"""Batch-norm backward on cuDNN where there is a GPU, on the CPU engine where there is none.

Checks ``grad_input``, ``grad_weight`` and ``grad_bias`` against central finite differences of
the training-mode forward pass, in float64 on the host, and prints a short summary.
"""

import time

import numpy as np

import cudnn_bn

SHAPE = (8, 4, 16)  # (N, C, L), as in the operator spec
EPS = 1e-5


def forward(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Training-mode batch norm: statistics per channel over N and L (biased variance)."""
    mean = x.mean(axis=(0, 2), keepdims=True)
    var = x.var(axis=(0, 2), keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * w[None, :, None] + b[None, :, None]


def finite_difference(x: np.ndarray, w: np.ndarray, b: np.ndarray, dy: np.ndarray, h: float = 1e-6):
    """Gradients of sum(dy * forward(x, w, b)) by central differences."""

    def loss(x_: np.ndarray, w_: np.ndarray, b_: np.ndarray) -> float:
        return float(np.sum(dy * forward(x_, w_, b_)))

    grads = []
    for index, arg in enumerate((x, w, b)):
        grad = np.empty_like(arg)
        for i in np.ndindex(arg.shape):
            args = [x, w, b]
            up, down = arg.copy(), arg.copy()
            up[i] += h
            down[i] -= h
            args[index] = up
            plus = loss(*args)
            args[index] = down
            grad[i] = (plus - loss(*args)) / (2 * h)
        grads.append(grad)
    return grads


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE) * 3 + 1
    dy = rng.standard_normal(SHAPE)
    w = rng.uniform(0.5, 1.5, SHAPE[1])
    b = rng.standard_normal(SHAPE[1])
    dtype = np.float32

    if cudnn_bn.nvidia_available():
        import cupy as xp

        info = cudnn_bn.cudnn_info()
        where = f"cuDNN {info.version_string} ({info.found_via}: {info.path})"
    else:
        xp = np
        where = "NumPy CPU backend (no usable GPU here)"
    args = [xp.asarray(a.astype(dtype)) for a in (x, dy, w)]

    start = time.perf_counter()
    grads = cudnn_bn.batch_norm_backward(*args, None, None, eps=EPS, mode="train")
    grads = [np.asarray(g.get() if hasattr(g, "get") else g, dtype=np.float64) for g in grads]
    elapsed = time.perf_counter() - start

    reference = finite_difference(
        x.astype(dtype).astype(np.float64),
        w.astype(dtype).astype(np.float64),
        b,
        dy.astype(dtype).astype(np.float64),
    )
    print(f"batch_norm_backward, input {SHAPE} float32, mode train, eps {EPS}")
    print(f"  ran on: {where}  ({elapsed * 1e3:.1f} ms including first-call setup)")
    worst = 0.0
    for name, got, ref in zip(
        ("grad_input", "grad_weight", "grad_bias"), grads, reference, strict=True
    ):
        error = float(np.max(np.abs(got - ref) / (np.abs(ref) + 1.0)))
        worst = max(worst, error)
        print(f"  {name:<12} max |error| / (|ref| + 1) vs finite differences: {error:.2e}")
    ok = worst < 1e-4  # float32 results against a float64 finite-difference gradient
    print("  check:", "PASSED" if ok else "FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
