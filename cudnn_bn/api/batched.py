"""``batch_norm_backward_batched``: B problems as one backward call.

functorch's batching rule for batch norm (``batch_norm_batch_rule``, seed 002) folds the batch
dimension into the channels (``reshape_dim_into(bdim, 1, input)``): ``(B, N, C, ...)`` data
becomes ``(N, B*C, ...)``, per-channel operands become ``(B*C,)``, and one backward runs
every problem at once. On either engine that is one pass over the shared call path
(``batched_pass``): the door on a new problem's operands (so B = 0 validates as much as any
other batch), address checks on a repeated one, then one launch that gathers what no view
folds and runs the folded backward (or, on the CPU, large problems in place).
"""

from typing import Any

from .backward import ALL_GRADIENTS, raw_options
from .batched_pass import BATCHED
from .call import run
from .spelling import array_api


@array_api
def batch_norm_backward_batched(
    input: Any,
    grad_output: Any,
    weight: Any,
    running_mean: Any,
    running_var: Any,
    *,
    saved_mean: Any = None,
    saved_invstd: Any = None,
    output: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    mode: str = "train",
    stream: Any = None,
    output_mask: tuple[bool, bool, bool] = ALL_GRADIENTS,
    fusion: str | None = None,
    persistent: bool | None = None,
) -> tuple[Any, ...]:
    """Batch-norm backward of ``B`` independent problems in one call (functorch's vmap rule).

    ``input``, ``grad_output`` (and a fused ``output``) are ``(B, N, C, ...)``; ``weight``,
    ``bias`` and the statistics are ``(C,)``, shared, or ``(B, C)``, one row per problem
    (``weight=None``: ones, no grad_weight). Returns ``grad_input`` shaped like ``input`` and
    ``grad_weight``/``grad_bias`` shaped ``(B, C)``; the other options are
    ``batch_norm_backward``'s (a fused one takes no reserve, each problem's would differ, so
    it runs where it needs none: the CuPy engine on NVIDIA).
    """
    arrays = (
        input,
        grad_output,
        output,
        weight,
        running_mean,
        running_var,
        saved_mean,
        saved_invstd,
        bias,
    )  # in BATCHED.names order
    raw = raw_options(mode, eps, fusion, output_mask, persistent, False)
    return run(BATCHED, arrays, raw, stream)
