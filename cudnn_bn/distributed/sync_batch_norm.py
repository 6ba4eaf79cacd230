"""Synchronized batch norm: PyTorch ``SyncBatchNorm``'s four steps, in float64.

Forward: every argument checked (``arguments.py``) and this rank's per-channel mean and M2
-> an all-gather of a fixed-size header carrying each rank's verdict (``agreement.py``), so
a rank whose arguments are bad, or which disagrees with the others, makes every rank raise
instead of hang -> one all-gather of each rank's (mean, M2) -> the global mean and biased
variance (Chan's pairwise update) -> the output normalized with them in float64 -> the
running statistics updated in place, last. Backward: arguments checked and the local
``sum(dy)`` and ``sum(dy * xhat)`` -> the header -> one all-reduce of those 2C values -> the
elementwise ``grad_input`` pass with the global sums. Nothing after the header can fail on
one rank only: what the caller passed was checked before it.

References: PyTorch ``torch/nn/modules/_functions.py`` (``SyncBatchNorm.forward/backward``),
ATen's ``batch_norm_gather_stats_with_counts`` (running statistics from the global unbiased
variance) and ``batch_norm_backward_elemt``.
"""

from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from ..api import TrainingOutputs
from ..enums import Status
from ..errors import InfiniError, raises_only_infini_errors
from .agreement import check_agreement, combine, counts, header
from .arguments import Checked, check_backward, check_forward
from .communicators import Communicator, communicator
from .kinds import kind_of, scope

FORWARD, BACKWARD = "sync_batch_norm_forward_training", "sync_batch_norm_backward"

# Messages already name the arguments as the caller does; anything else is a bug, and
# becomes INTERNAL_ERROR.
_distributed_api = raises_only_infini_errors({})


class _Stream:
    """The stream a GPU communicator queues on: the pass's, once its arguments are checked;
    until then (and where they were refused) the legacy default stream."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def _run(
    comm: Communicator, stream: _Stream, local: Callable[[], tuple[Checked, Any, np.ndarray]]
) -> tuple[Checked, Any, np.ndarray]:
    """``local()`` -> (checked arguments, result, this rank's header); all-gather the
    headers; raise this rank's own error, or the one every rank reaches from the headers;
    else (checked, result, headers)."""
    try:
        checked, result, mine = local()
        stream.value = checked.stream
        error = None
    except Exception as exc:  # any failure here must still reach the other ranks
        checked, result, error = None, None, exc
        mine = header(exc.status if isinstance(exc, InfiniError) else Status.INTERNAL_ERROR)
    headers = comm.allgather(mine)
    if error is not None:
        raise error
    return checked, result, headers


def refuse_on_every_rank(group: Any, error: InfiniError) -> NoReturn:
    """Raise ``error``, this rank's refusal of a synchronized pass it never started (a layer's
    own check), once every rank of ``group`` has it in the pass's header exchange, where the
    others wait: they raise too, instead of waiting for ever."""
    comm = communicator(group, _Stream())
    comm.allgather(header(error.status))
    raise error


def _host(array: Any, default: float, channels: int) -> np.ndarray:
    """A per-channel array as host float64; ``default`` everywhere where it is None."""
    if array is None:
        return np.full(channels, default)
    return kind_of("", array).host(array)


@_distributed_api
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
    ``weight``/``bias`` None mean 1 and 0 (PyTorch's ``affine=False``). The statistics stay
    in float64 until the output is rounded to the input's dtype. Where every rank has N = 0
    the outputs are empty and the running statistics are left as they are.

    ``group`` is an mpi4py communicator, a torch.distributed process group or a
    ``cupy.cuda.nccl.NcclCommunicator``; every rank of it must make this call. Each rank sends
    ``8 * (10 + 2C)`` bytes (a header, then its mean and M2). Any rank's bad argument, or
    ranks that disagree on the shape but N, the dtype, eps or momentum, raise ``InfiniError``
    on every rank, and no rank writes anything.
    """
    arrays = dict(
        input=input, weight=weight, bias=bias, running_mean=running_mean, running_var=running_var
    )
    stream_now = _Stream()
    comm = communicator(group, stream_now)

    def local() -> tuple[Checked, Any, np.ndarray]:
        checked, fraction, epsilon = check_forward(comm, arrays, momentum, eps, stream)
        channels = checked.channels
        with scope(input, checked.stream, checked.device_id):
            if checked.count:
                mean, m2 = checked.kind.moments(input)
            else:
                mean, m2 = np.zeros(channels), np.zeros(channels)
            w, b = _host(weight, 1.0, channels), _host(bias, 0.0, channels)
        x = checked.ops["input"].desc
        result = (mean, m2, w, b, fraction, epsilon)
        return checked, result, header(0, checked.count, x.shape, x.dtype, (epsilon, fraction))

    checked, (mean, m2, w, b, fraction, epsilon), headers = _run(comm, stream_now, local)
    check_agreement(headers, FORWARD, "eps and momentum")
    n = int(counts(headers).sum())
    if n == 1:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"{FORWARD}: 1 value per channel on all ranks together; training needs more",
        )
    channels, kind = checked.channels, checked.kind
    gathered = comm.allgather(np.concatenate([mean, m2]))
    _, mean, m2 = combine(counts(headers), gathered[:, :channels], gathered[:, channels:])
    var = m2 / n if n else m2
    with scope(input, checked.stream, checked.device_id), np.errstate(divide="ignore"):
        # torch's ``InvStd``, as the engines' batch statistics: 0 for 0 variance and eps 0
        invstd = np.where((var == 0) & (epsilon == 0), 0.0, 1.0 / np.sqrt(var + epsilon))
        output = kind.normalize(input, (mean, invstd * w, b))
        saved_mean, saved_invstd = kind.statistics(mean, input), kind.statistics(invstd, input)
        if n:
            batch = dict(running_mean=mean, running_var=var * (n / (n - 1)))
            for name, target in dict(running_mean=running_mean, running_var=running_var).items():
                if target is not None:
                    target_kind = kind_of(name, target)
                    moved = (1 - fraction) * target_kind.host(target) + fraction * batch[name]
                    target_kind.assign(target, moved)
    return TrainingOutputs(output, saved_mean, saved_invstd, None)


@_distributed_api
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
    rank, after a header of 80), in float64 until rounded to the input's dtype;
    ``grad_weight = sum(dy * xhat)`` and ``grad_bias = sum(dy)`` are this rank's own, in the
    weight's dtype, as in PyTorch ``SyncBatchNorm``: the data-parallel wrapper reduces
    parameter gradients. ``weight=None`` means 1 and no ``grad_weight`` (None); ``grad_bias``
    is still ``sum(dy)`` (for a bias without a weight, as PyTorch's), in the saved
    statistics' dtype. A rank with N = 0 gets an empty ``grad_input`` and zero
    ``grad_weight``/``grad_bias``. ``output_mask`` asks only for some gradients (the others
    are None); without ``grad_input`` the ranks only exchange the header. Faults raise on
    every rank, as in the forward.
    """
    arrays = dict(
        input=input,
        grad_output=grad_output,
        weight=weight,
        saved_mean=saved_mean,
        saved_invstd=saved_invstd,
    )
    stream_now = _Stream()
    comm = communicator(group, stream_now)

    def local() -> tuple[Checked, Any, np.ndarray]:
        checked, mask = check_backward(comm, arrays, output_mask, stream)
        channels = checked.channels
        with scope(input, checked.stream, checked.device_id):
            mean, invstd = _host(saved_mean, 0.0, channels), _host(saved_invstd, 0.0, channels)
            w = _host(weight, 1.0, channels)
            if checked.count:
                sum_dy, sum_dy_xhat = checked.kind.sums(input, grad_output, mean, invstd)
            else:
                sum_dy, sum_dy_xhat = np.zeros(channels), np.zeros(channels)
        x = checked.ops["input"].desc
        params = (float(mask[0]), 0.0)
        result = (mask, mean, invstd, w, sum_dy, sum_dy_xhat)
        return checked, result, header(0, checked.count, x.shape, x.dtype, params)

    checked, (mask, mean, invstd, w, sum_dy, sum_dy_xhat), headers = _run(comm, stream_now, local)
    check_agreement(headers, BACKWARD, "whether grad_input is wanted (output_mask)")
    channels = checked.channels
    grads: list[Any] = [None, None, None]
    if mask[0]:
        reduced = comm.allreduce(np.concatenate([sum_dy, sum_dy_xhat]))
        n = counts(headers).sum()
        with np.errstate(all="ignore"):
            terms = (mean, invstd * reduced[channels:] / n, reduced[:channels] / n, w * invstd)
        with scope(input, checked.stream, checked.device_id):
            grads[0] = checked.kind.grad_input(input, grad_output, terms)
    # a parameter's dtype and place: the weight's, else the saved statistics' (grad_bias)
    like, name = (weight, "weight") if weight is not None else (saved_mean, "saved_mean")
    like_kind = kind_of(name, like)
    with scope(like, checked.stream, checked.device_id), np.errstate(over="ignore"):
        for i, total in ((1, sum_dy_xhat), (2, sum_dy)):
            if mask[i] and (i == 2 or weight is not None):
                grads[i] = like_kind.like(total, like)
    return tuple(grads)
