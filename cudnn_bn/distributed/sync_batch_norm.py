"""Synchronized batch norm: PyTorch ``SyncBatchNorm``'s four steps on ``cudnn_bn``'s operators.

Forward: local statistics (the training-forward operator, on this rank's engine) -> one
all-gather of each rank's (mean, M2) with its count -> global mean and biased variance
(Chan's pairwise update) -> output through the inference-forward operator with the global
statistics -> running statistics updated in place, last. Backward: local ``sum(dy)`` and
``sum(dy * xhat)`` (the backward operator in saved mode, grad_input masked off) -> one
all-reduce of those 2C values -> the elementwise ``grad_input`` pass with the global sums.
Each pass first all-gathers a fixed-size header (``agreement.py``), so a rank whose arguments
are bad, or which disagrees with the others, makes every rank raise instead of hang.

References: PyTorch ``torch/nn/modules/_functions.py`` (``SyncBatchNorm.forward/backward``),
ATen's ``batch_norm_gather_stats_with_counts`` (running statistics from the global unbiased
variance) and ``batch_norm_backward_elemt``.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..api import (
    TrainingOutputs,
    batch_norm_backward,
    batch_norm_forward_inference,
    batch_norm_forward_training,
    resolve_stream,
)
from ..arrays import operand
from ..enums import Status
from ..errors import InfiniError
from ..ops.validation import HALF_DTYPES, check_eps, check_fraction, check_output_mask
from .agreement import check_agreement, combine, counts, header
from .communicators import Communicator, communicator
from .kinds import kind_of

FORWARD, BACKWARD = "sync_batch_norm_forward_training", "sync_batch_norm_backward"


def _require(arrays: dict[str, Any]) -> None:
    for name, array in arrays.items():
        if array is None:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")


def _count(x: Any) -> int:
    """Values per channel on this rank; BAD_TENSOR_SHAPE below two dimensions."""
    shape = tuple(x.shape)
    if len(shape) < 2:
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"input has shape {shape}; expected (N, C, ...)")
    return math.prod(shape) // shape[1] if shape[1] else 0


def _probe(kind: Any, like: Any) -> Any:
    """A ``(2, C, 1, ...)`` zero stand-in for ``like``: the operators check every other
    argument against it where this rank has too few samples to run them on its own data."""
    return kind.zeros((2, like.shape[1]) + (1,) * (like.ndim - 2), like)


def _run(comm: Communicator, local: Any, pass_name: str, params: str) -> tuple[Any, np.ndarray]:
    """``local()`` -> (result, this rank's header); all-gather the headers; raise this rank's
    own error, or the one every rank reaches from the headers; else (result, headers)."""
    try:
        result, mine = local()
        error = None
    except Exception as exc:  # any failure here must still reach the other ranks
        result, error = None, exc
        mine = header(exc.status if isinstance(exc, InfiniError) else Status.INTERNAL_ERROR)
    headers = comm.allgather(mine)
    if error is not None:
        raise error
    check_agreement(headers, pass_name, params)
    return result, headers


def _stream_for(stream: Any, like: Any) -> Any:
    """The pass's ``cudaStream_t`` address, asked for only by a GPU communicator."""
    return lambda: resolve_stream(stream, like)


@dataclass
class _Statistics:
    """One rank's share: values per channel, per-channel mean and M2 (host float64), and an
    array of the dtype, kind and device the saved statistics take."""

    count: int
    mean: np.ndarray
    m2: np.ndarray
    stats_like: Any


def _local_statistics(
    x: Any, w: Any, b: Any, running: dict[str, Any], momentum: float, eps: float, stream: Any
) -> _Statistics:
    """This rank's statistics from the training-forward operator, which also checks every
    argument (on copies of the running statistics: only the global update may touch them).

    The operator saves ``mean`` and ``invstd = 1/sqrt(var + eps)``; ``var`` comes back as
    ``1/invstd**2 - eps``. That recovers ``var + eps`` to a few ulps of the saved dtype, which
    is all the output and the saved invstd depend on; only a running variance far below eps
    loses relative digits (absolute error ~ eps * ulp)."""
    kind = kind_of("input", x)
    count = _count(x)
    copies = {}
    for name, array in running.items():
        if array is not None:
            running_kind = kind_of(name, array)
            if not running_kind.writable(array):
                raise InfiniError(Status.BAD_PARAM, f"{name} is read-only; it is updated in place")
            copies[name] = running_kind.copy(array)
    own = count >= 2  # the operators need two values per channel to train
    probe = x if own else _probe(kind, x)
    _, mean, invstd = batch_norm_forward_training(
        probe, w, b, copies.get("running_mean"), copies.get("running_var"),
        momentum=momentum, eps=eps, stream=stream,
    )  # fmt: skip
    channels = x.shape[1]
    with kind.scope(stream, x):
        if own:
            local_mean = kind.host(mean)
            with np.errstate(divide="ignore"):
                var = np.maximum(1.0 / kind.host(invstd) ** 2 - eps, 0.0)
            m2 = count * var
        elif count == 1:
            local_mean, m2 = kind.host(x).reshape(channels), np.zeros(channels)
        else:
            local_mean, m2 = np.zeros(channels), np.zeros(channels)
    return _Statistics(count, local_mean, m2, mean)


def sync_batch_norm_forward_training(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    *,
    group: Any,
    momentum: float = 0.1,
    eps: float = 1e-5,
    stream: Any = None,
) -> TrainingOutputs:
    """Training-mode batch norm over the global batch: every sample of every rank of ``group``.

    Returns what ``cudnn_bn.batch_norm_forward_training`` returns, ``(output, saved_mean,
    saved_invstd)``, with PyTorch ``SyncBatchNorm``'s semantics: the mean and biased variance
    are those of the union of all ranks' batches (per-rank batch sizes may differ, and a rank
    with N = 0 takes part and gets an empty output); ``saved_mean`` is the global mean and
    ``saved_invstd`` ``1/sqrt(var + eps)``, F32 for F16/BF16 input, ready for
    ``sync_batch_norm_backward``; ``running_mean``/``running_var`` (either may be None) move
    by ``momentum`` towards the global mean and the global unbiased variance, in place.

    ``group`` is an mpi4py communicator, a torch.distributed process group or a
    ``cupy.cuda.nccl.NcclCommunicator``; every rank of it must make this call. Each rank sends
    ``8 * (10 + 2C)`` bytes (a header, then its mean and M2). Any rank's bad argument, or
    ranks that disagree on the shape but N, the dtype, eps or momentum, raise ``InfiniError``
    on every rank, and no rank writes anything.
    """
    arrays = dict(input=input, weight=weight, bias=bias)
    x = input
    comm = communicator(group, _stream_for(stream, x))

    def local() -> tuple[_Statistics, np.ndarray]:
        _require(arrays)
        m, e = check_fraction("momentum", momentum), check_eps(eps)
        running = dict(running_mean=running_mean, running_var=running_var)
        stats = _local_statistics(x, weight, bias, running, m, e, stream)
        dtype = operand("input", x).desc.dtype
        return stats, header(0, stats.count, tuple(x.shape), dtype, (e, m))

    stats, headers = _run(comm, local, FORWARD, "eps and momentum")
    momentum, eps = float(momentum), float(eps)  # checked on every rank by now
    n = int(counts(headers).sum())
    if n <= 1:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"{FORWARD}: {n} value(s) per channel on all ranks together; "
            "training needs more than one",
        )
    channels = x.shape[1]
    gathered = comm.allgather(np.concatenate([stats.mean, stats.m2]))
    n, mean, m2 = combine(counts(headers), gathered[:, :channels], gathered[:, channels:])
    var = m2 / n
    kind = kind_of("input", x)
    with kind.scope(stream, x), np.errstate(divide="ignore"):
        mean_array, var_array = kind.like(mean, stats.stats_like), kind.like(var, stats.stats_like)
        if stats.count:
            output = batch_norm_forward_inference(
                x, weight, bias, mean_array, var_array, eps=eps, stream=stream
            )
        else:
            output = kind.empty(x)
        saved_invstd = kind.like(1.0 / np.sqrt(var + eps), stats.stats_like)
        batch = dict(running_mean=mean, running_var=var * (n / (n - 1)))
        for name, target in dict(running_mean=running_mean, running_var=running_var).items():
            if target is not None:
                running_kind = kind_of(name, target)
                old = running_kind.host(target)
                running_kind.assign(target, (1.0 - momentum) * old + momentum * batch[name])
    return TrainingOutputs(output, mean_array, saved_invstd, None)


@dataclass
class _Sums:
    """One rank's share of the backward: values per channel, ``sum(dy)`` and
    ``sum(dy * xhat)`` (host float64), and its local ``grad_weight``/``grad_bias``."""

    count: int
    sum_dy: np.ndarray
    sum_dy_xhat: np.ndarray
    grad_weight: Any
    grad_bias: Any


def _local_sums(
    x: Any, dy: Any, w: Any, saved: dict[str, Any], mask: tuple[bool, bool, bool], stream: Any
) -> _Sums:
    """``sum(dy)`` and ``sum(dy * xhat)`` from the backward operator in saved mode, which
    checks every argument; its grad_input is masked off (the global one comes later). For
    F16/BF16 data with a weight of the same dtype, the sums are taken in F32 (a float32 copy
    of the weight, which only scales the masked-off grad_input): half sums would lose digits,
    or overflow, before the reduction."""
    kind, weight_kind = kind_of("input", x), kind_of("weight", w)
    count = _count(x)
    if tuple(dy.shape) != tuple(x.shape):
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"grad_output has shape {tuple(dy.shape)} but input has {tuple(x.shape)}",
        )
    data_dtype = operand("input", x).desc.dtype
    widen = data_dtype in HALF_DTYPES and operand("weight", w).desc.dtype == data_dtype
    probe_x, probe_dy = (
        (x, dy) if count else (_probe(kind, x), _probe(kind_of("grad_output", dy), dy))
    )
    _, sum_dy_xhat, sum_dy = batch_norm_backward(
        probe_x, probe_dy, weight_kind.float32(w) if widen else w, None, None,
        mode="saved", saved_mean=saved["saved_mean"], saved_invstd=saved["saved_invstd"],
        output_mask=(False, mask[0] or mask[1], mask[0] or mask[2]), stream=stream,
    )  # fmt: skip
    channels = x.shape[1]
    with kind.scope(stream, x):
        sums = {
            name: weight_kind.host(array) if count and array is not None else np.zeros(channels)
            for name, array in (("sum_dy", sum_dy), ("sum_dy_xhat", sum_dy_xhat))
        }
        grads = {}
        for name, array, total, wanted in (
            ("grad_weight", sum_dy_xhat, sums["sum_dy_xhat"], mask[1]),
            ("grad_bias", sum_dy, sums["sum_dy"], mask[2]),
        ):
            grads[name] = None
            if wanted:
                grads[name] = array if count and not widen else weight_kind.like(total, w)
    return _Sums(count, sums["sum_dy"], sums["sum_dy_xhat"], **grads)


def sync_batch_norm_backward(
    input: Any,
    grad_output: Any,
    weight: Any,
    saved_mean: Any,
    saved_invstd: Any,
    *,
    group: Any,
    stream: Any = None,
    output_mask: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Any, Any, Any]:
    """``(grad_input, grad_weight, grad_bias)`` of ``sync_batch_norm_forward_training``.

    ``saved_mean``/``saved_invstd`` are what that forward returned (the global statistics).
    ``grad_input = w * invstd * (dy - sum(dy)/N - xhat * sum(dy * xhat)/N)`` with the sums
    and N over every rank of ``group`` (one all-reduce of 2C values: ``8 * 2C`` bytes per
    rank, after a header of 80); ``grad_weight = sum(dy * xhat)`` and ``grad_bias =
    sum(dy)`` are this rank's own, as in PyTorch ``SyncBatchNorm``: the data-parallel wrapper
    reduces parameter gradients. A rank with N = 0 gets an empty ``grad_input`` and zero
    ``grad_weight``/``grad_bias``. ``output_mask`` asks only for some gradients (the others
    are None); without ``grad_input`` the ranks only exchange the header. Faults raise on
    every rank, as in the forward.
    """
    x = input
    saved = dict(saved_mean=saved_mean, saved_invstd=saved_invstd)
    comm = communicator(group, _stream_for(stream, x))
    mask = (True, True, True)

    def local() -> tuple[_Sums, np.ndarray]:
        nonlocal mask
        _require(dict(input=x, grad_output=grad_output, weight=weight, **saved))
        mask = check_output_mask(output_mask)
        sums = _local_sums(x, grad_output, weight, saved, mask, stream)
        dtype = operand("input", x).desc.dtype
        return sums, header(0, sums.count, tuple(x.shape), dtype, (float(mask[0]), 0.0))

    sums, headers = _run(comm, local, BACKWARD, "whether grad_input is wanted (output_mask)")
    grad_input = None
    if mask[0]:
        channels = x.shape[1]
        reduced = comm.allreduce(np.concatenate([sums.sum_dy, sums.sum_dy_xhat]))
        kind = kind_of("input", x)
        if sums.count:
            n = counts(headers).sum()
            with kind.scope(stream, x):
                mean, invstd = kind.host(saved_mean), kind.host(saved_invstd)
                w = kind_of("weight", weight).host(weight)
                with np.errstate(all="ignore"):
                    terms = (
                        mean,
                        invstd * reduced[channels:] / n,
                        reduced[:channels] / n,
                        w * invstd,
                    )
                grad_input = kind.grad_input(x, grad_output, terms)
        else:
            grad_input = kind.empty(x)
    return grad_input, sums.grad_weight, sums.grad_bias
