"""Train ``train_mnist_like.py``'s network data-parallel, its batch norms synchronized.

    mpiexec -n 2 python examples/train_distributed.py

Every rank holds the whole model and draws the same global batches as the single-process
``train_mnist_like.py`` (same seed, same order); each rank takes its share of a batch (uneven
where the ranks do not divide it). The batch norms are ``cudnn_bn.nn.SyncBatchNorm`` layers
(``cudnn_bn.distributed`` underneath): their statistics are those of the global batch, so
every activation equals the single-process one. The parameter gradients (each rank's share of
the global-batch loss; the layers' ``weight_grad``/``bias_grad`` too) are summed over the ranks
with one MPI all-reduce per step, and every rank takes the same SGD step: the loss curve is the
single-process run's, to rounding. Rank 0 prints it. NumPy and the CPU backend
without a GPU; CuPy (one GPU per rank, the statistics staged through the host for MPI) with.
Exits non-zero unless the loss at least halves.
"""

import time

import numpy as np
from mpi4py import MPI
from train_mnist_like import (
    BATCH,
    CLASSES,
    EPS,
    FEATURES,
    HIDDEN,
    LEARNING_RATE,
    MOMENTUM,
    SAMPLES,
    STEPS,
    finish,
    forward,
    make_data,
    sgd_step,
)

import cudnn_bn
from cudnn_bn.nn import SyncBatchNorm


def allreduce(comm: MPI.Comm, xp, arrays: list) -> list:
    """The sums over the ranks of ``arrays``, in one all-reduce of one host buffer."""
    host = [a.get() if xp is not np else a for a in arrays]
    packed = np.concatenate([a.ravel() for a in host]).astype(np.float64)
    comm.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)
    pieces = np.split(packed, np.cumsum([a.size for a in host])[:-1])
    return [xp.asarray(p.reshape(a.shape), a.dtype) for p, a in zip(pieces, host, strict=True)]


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)  # the single-process run's seed and draws, in its order
    points, labels = make_data(rng)
    if cudnn_bn.nvidia_available():
        import cupy as xp

        xp.cuda.Device(rank % xp.cuda.runtime.getDeviceCount()).use()
        where = f"cuDNN {cudnn_bn.cudnn_info().version_string} (CuPy arrays)"
    else:
        xp = np
        where = "NumPy CPU backend (no usable GPU here)"
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    say(f"training on: {where}, {ranks} ranks, a global batch of {BATCH}")

    def weight(fan_in: int, fan_out: int):
        return xp.asarray(rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in), xp.float32)

    w1, w2, w3 = weight(FEATURES, HIDDEN), weight(HIDDEN, HIDDEN), weight(HIDDEN, CLASSES)
    b3 = xp.zeros(CLASSES, xp.float32)
    bn1, bn2 = (
        SyncBatchNorm(HIDDEN, eps=EPS, momentum=MOMENTUM, fusion="relu", group=comm) for _ in "12"
    )
    x_all, t_all = xp.asarray(points), xp.asarray(labels)

    start = time.perf_counter()
    losses = []
    say(" step    loss")
    for step in range(STEPS):
        batch = rng.choice(SAMPLES, BATCH, replace=False)
        mine = xp.asarray(np.array_split(batch, ranks)[rank])
        x, t = x_all[mine], t_all[mine]
        a1, a2, log_p = forward(xp, x, (w1, w2, w3, b3), (bn1, bn2))
        rows = xp.arange(len(mine))
        grad_logits = xp.exp(log_p)  # softmax - one_hot, over the global batch
        grad_logits[rows, t] -= 1
        grad_logits /= BATCH
        grad_w3, grad_b3 = a2.T @ grad_logits, grad_logits.sum(axis=0)
        grad_h2 = bn2.backward(grad_logits @ w3.T)
        grad_w2 = a1.T @ grad_h2
        grad_h1 = bn1.backward(grad_h2 @ w2.T)
        grad_w1 = x.T @ grad_h1
        local_loss = -log_p[rows, t].sum().reshape(1)
        loss, *grads = allreduce(
            comm,
            xp,
            [local_loss, grad_w1, grad_w2, grad_w3, grad_b3]
            + [grad for bn in (bn1, bn2) for grad in (bn.weight_grad, bn.bias_grad)],
        )
        losses.append(float(loss[0]) / BATCH)
        if step % 5 == 0 or step == STEPS - 1:
            say(f"{step:5d}  {losses[-1]:.4f}")
        for param, grad in zip((w1, w2, w3, b3), grads[:4], strict=True):
            param -= LEARNING_RATE * grad
        for bn, (gamma, beta) in zip((bn1, bn2), (grads[4:6], grads[6:]), strict=True):
            bn.weight_grad, bn.bias_grad = gamma, beta  # the sums over the ranks
            sgd_step(bn, LEARNING_RATE)

    bn1.eval()
    bn2.eval()
    logits = bn2(bn1(x_all @ w1) @ w2) @ w3 + b3
    finish(losses, logits, t_all, time.perf_counter() - start, say)


if __name__ == "__main__":
    main()
