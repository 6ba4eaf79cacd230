"""Synchronized batch norm across processes: PyTorch ``SyncBatchNorm`` semantics in float64
on the caller's NumPy, CuPy or torch arrays, communicating through mpi4py, torch.distributed
or CuPy's NCCL, behind the array API's checks (``arguments.py``).

``sync_batch_norm_forward_training`` normalizes with the mean and biased variance of the
global batch (every sample on every rank of ``group``) and moves the running statistics
towards the global unbiased variance; ``sync_batch_norm_backward`` gives ``grad_input`` from
the globally reduced ``sum(dy)`` and ``sum(dy * xhat)``, and this rank's own
``grad_weight``/``grad_bias``. Importing this package imports no distributed engine.
"""

from .sync_batch_norm import sync_batch_norm_backward, sync_batch_norm_forward_training

__all__ = ["sync_batch_norm_backward", "sync_batch_norm_forward_training"]
