"""The array API: batch-norm passes over NumPy, CuPy and torch arrays; raises ``InfiniError``.

Each pass is a short module over one shared call path (``call.py``): its arrays become
operands through the one door, a per-problem plan (validation, descriptor, output layouts,
sizes) is found by a cheap key or built once, outputs and workspace come from the input's
own library on the arrays' device and the call's stream, and the operator runs.
"""

from .backward import batch_norm_backward
from .batched import batch_norm_backward_batched
from .call import descriptor_cache
from .forward import TrainingOutputs, batch_norm_forward_inference, batch_norm_forward_training
from .streams import resolve_stream

__all__ = [
    "TrainingOutputs",
    "batch_norm_backward",
    "batch_norm_backward_batched",
    "batch_norm_forward_inference",
    "batch_norm_forward_training",
    "descriptor_cache",
    "resolve_stream",
]
