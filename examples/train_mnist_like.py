"""Train a small fully connected network whose batch norms are cudnn_bn's, forward and backward.

The data are made here: 10 classes of Gaussian blobs in 64 dimensions (fixed seed). The network
is Linear -> batch norm -> ReLU -> Linear -> batch norm -> ReLU -> Linear -> softmax
cross-entropy, trained with plain SGD. Each batch norm + ReLU is one ``cudnn_bn.nn.BatchNorm``
layer (``fusion="relu"``) on the ``(N, C)`` activations: in training mode its forward
normalizes with the batch statistics and moves the running ones, its ``backward`` returns the
gradient with respect to its input and accumulates gamma's and beta's; the final accuracy is
measured in eval mode (the running statistics). CuPy and cuDNN where a GPU is usable, NumPy and
the CPU engine otherwise. Exits non-zero unless the loss at least halves.
"""

import time

import numpy as np

import cudnn_bn
from cudnn_bn.nn import BatchNorm

CLASSES, FEATURES, HIDDEN = 10, 64, 128
SAMPLES, BATCH, STEPS = 4096, 256, 60
LEARNING_RATE, MOMENTUM, EPS = 0.1, 0.1, 1e-5


def make_data(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``SAMPLES`` points around ``CLASSES`` random centres, and their labels."""
    centres = rng.standard_normal((CLASSES, FEATURES)) * 0.6
    labels = rng.integers(0, CLASSES, SAMPLES)
    points = centres[labels] + rng.standard_normal((SAMPLES, FEATURES))
    return points.astype(np.float32), labels


def batch_norm_relu(channels: int) -> BatchNorm:
    """``relu(batch_norm(h))`` over ``(N, C)``: one layer owns gamma/beta, the running
    statistics and what its backward needs."""
    return BatchNorm(channels, eps=EPS, momentum=MOMENTUM, fusion="relu")


def sgd_step(bn: BatchNorm, lr: float) -> None:
    """Plain SGD on a batch norm's gamma (``weight``) and beta (``bias``), then forget their
    gradients (the layer accumulates them, as torch does)."""
    bn.weight -= lr * bn.weight_grad
    bn.bias -= lr * bn.bias_grad
    bn.zero_grad()


def forward(xp, x, weights: tuple, bns: tuple) -> tuple:
    """The network in training mode: both hidden activations and the log-softmax."""
    (w1, w2, w3, b3), (bn1, bn2) = weights, bns
    a1 = bn1(x @ w1)
    a2 = bn2(a1 @ w2)
    logits = a2 @ w3 + b3
    shifted = logits - logits.max(axis=1, keepdims=True)
    return a1, a2, shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))


def main() -> None:
    rng = np.random.default_rng(0)
    points, labels = make_data(rng)
    if cudnn_bn.nvidia_available():
        import cupy as xp

        info = cudnn_bn.cudnn_info()
        where = f"cuDNN {info.version_string} (CuPy arrays)"
    else:
        xp = np
        where = "NumPy CPU backend (no usable GPU here)"
    print(f"training on: {where}")

    def weight(fan_in: int, fan_out: int):
        return xp.asarray(rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in), xp.float32)

    w1, w2, w3 = weight(FEATURES, HIDDEN), weight(HIDDEN, HIDDEN), weight(HIDDEN, CLASSES)
    b3 = xp.zeros(CLASSES, xp.float32)
    bn1, bn2 = batch_norm_relu(HIDDEN), batch_norm_relu(HIDDEN)
    x_all, t_all = xp.asarray(points), xp.asarray(labels)

    start = time.perf_counter()
    losses = []
    print(" step    loss")
    for step in range(STEPS):
        batch = xp.asarray(rng.choice(SAMPLES, BATCH, replace=False))
        x, t = x_all[batch], t_all[batch]
        a1, a2, log_p = forward(xp, x, (w1, w2, w3, b3), (bn1, bn2))
        loss = float(-log_p[xp.arange(BATCH), t].mean())
        losses.append(loss)
        if step % 5 == 0 or step == STEPS - 1:
            print(f"{step:5d}  {loss:.4f}")

        grad_logits = xp.exp(log_p)  # softmax - one_hot, averaged over the batch
        grad_logits[xp.arange(BATCH), t] -= 1
        grad_logits /= BATCH
        grad_w3, grad_b3 = a2.T @ grad_logits, grad_logits.sum(axis=0)
        grad_h2 = bn2.backward(grad_logits @ w3.T)
        grad_w2 = a1.T @ grad_h2
        grad_h1 = bn1.backward(grad_h2 @ w2.T)
        grad_w1 = x.T @ grad_h1
        for param, grad in ((w1, grad_w1), (w2, grad_w2), (w3, grad_w3), (b3, grad_b3)):
            param -= LEARNING_RATE * grad
        sgd_step(bn1, LEARNING_RATE)
        sgd_step(bn2, LEARNING_RATE)

    bn1.eval()
    bn2.eval()
    logits = bn2(bn1(x_all @ w1) @ w2) @ w3 + b3
    finish(losses, logits, t_all, time.perf_counter() - start)


def finish(losses: list[float], logits, targets, elapsed: float, say=print) -> None:
    """Report the run (loss curve's ends, accuracy in inference mode) and exit with 0 if the
    loss halved, 1 if not."""
    accuracy = float((logits.argmax(axis=1) == targets).mean())
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps ({elapsed:.2f} s)")
    say(f"train accuracy (inference mode, running statistics): {accuracy:.1%}")
    ok = losses[-1] < 0.5 * losses[0]
    say("check:", "PASSED" if ok else "FAILED (the loss did not halve)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
