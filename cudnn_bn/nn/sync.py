"""``SyncBatchNorm``: ``BatchNorm`` whose training statistics are those of the global batch,
every sample on every process of a group, as ``torch.nn.SyncBatchNorm``.

Reference: PyTorch ``torch/nn/modules/batchnorm.py`` (``SyncBatchNorm.forward``): only a
training forward synchronizes; eval mode is ``BatchNorm``'s, on this process's batch.
"""

from typing import Any

from ..distributed import sync_batch_norm_backward, sync_batch_norm_forward_training
from ..distributed.sync_batch_norm import refuse_on_every_rank
from ..errors import InfiniError
from .batch_norm import Backward, BatchNorm, _public, add_relu, check_like_input, wanted


class SyncBatchNorm(BatchNorm):
    """``BatchNorm(num_features, ...)`` synchronized over ``group`` (an mpi4py
    communicator, a torch.distributed process group or CuPy's NCCL communicator): every
    process of it must call ``forward`` and ``backward`` together in training mode. Batch
    sizes may differ between processes (N = 0 included). ``weight_grad``/``bias_grad`` are
    this process's share, to be summed over the processes with the other parameter
    gradients (as torch's data-parallel wrapper does); the running statistics move towards
    the global batch's, identically on every process. A fused training forward applies
    ``relu(... [+ z])`` to the synchronized output, and its backward masks ``grad_output``
    by it (``cudnn_bn.distributed`` has no fused pass). What the layer refuses itself on one
    rank (an input of another library, a bad ``z``, ``eps=0``, a fused backward's
    ``grad_output``) raises on every rank, as the synchronized passes' own refusals do."""

    def __init__(self, num_features: int, *args: Any, group: Any, **kwargs: Any) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.group = group
        self._synchronizing = False

    @_public
    def forward(self, input: Any, z: Any = None) -> Any:
        """``BatchNorm.forward``; in training mode a refusal on this rank before the
        synchronized pass (a bad input or ``z``, a setting of this rank's layer) reaches
        every rank of ``group`` in that pass's header exchange, where the others wait, so
        that all raise."""
        self._synchronizing = False
        try:
            return super().forward(input, z)
        except InfiniError as exc:
            if self.training and not self._synchronizing:
                refuse_on_every_rank(self.group, exc)
            raise

    __call__ = forward

    @classmethod
    def convert_sync_batchnorm(cls, module: Any, group: Any) -> Any:
        """torch's: a ``BatchNorm`` (a ``SyncBatchNorm`` too) as a new ``SyncBatchNorm`` over
        ``group`` with its flags, mode, fusion, count (a copy: an int) and arrays (the same
        arrays, as torch's shares its parameters and buffers; made apart if not yet made);
        a list, tuple or dict as a new one of its items converted (the layers of a model kept
        in one); anything else as it is."""
        if isinstance(module, BatchNorm):
            sync = cls.__new__(cls)
            state = module.__getstate__()
            if state["_pending"] is not None:
                state["_pending"] = dict(state["_pending"])
            sync.__dict__.update(state, group=group)
            return sync
        if isinstance(module, list | tuple):
            converted = [cls.convert_sync_batchnorm(m, group) for m in module]
            return converted if isinstance(module, list) else tuple(converted)
        if isinstance(module, dict):  # its own type: an OrderedDict stays one
            items = ((k, cls.convert_sync_batchnorm(m, group)) for k, m in module.items())
            return type(module)(items)
        return module

    def _batch_pass(
        self,
        input: Any,
        z: Any,
        weight: Any,
        bias: Any,
        running_mean: Any,
        running_var: Any,
        momentum: float,
    ) -> tuple[Any, Backward]:
        if not self.training:  # torch: eval mode never synchronizes
            return super()._batch_pass(input, z, weight, bias, running_mean, running_var, momentum)
        check_like_input("z", z, input)  # on this rank, before the collectives
        self._synchronizing = True  # from here every rank reaches the same verdict
        output, mean, invstd = sync_batch_norm_forward_training(
            input, weight, bias, running_mean, running_var,
            group=self.group, momentum=momentum, eps=self.eps,
        )  # fmt: skip
        if self.fusion:
            output = add_relu(output, z)

        def backward(grad_output: Any) -> tuple[Any, ...]:
            if self.fusion:
                try:
                    check_like_input("grad_output", grad_output, input)
                except InfiniError as exc:  # in the pass's header exchange: all raise
                    refuse_on_every_rank(self.group, exc)
                grad_output = grad_output * (output > 0)
            grads = sync_batch_norm_backward(
                input, grad_output, weight, mean, invstd,
                group=self.group, output_mask=wanted(weight, bias),
            )  # fmt: skip
            return (*grads, grad_output) if self.fusion == "add_relu" else grads

        return output, backward
