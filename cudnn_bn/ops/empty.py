"""The kernel of a problem with no values per channel (a zero dimension other than C).

PyTorch's ``batch_norm`` on such input (``_batch_norm_impl_index``, ``input.numel() == 0``)
runs no backend: the output is empty, the running statistics are left as they are, the
saved mean and invstd are ``at::empty`` (never written), and the backward's grad_weight and
grad_bias are zeros. So here: no backend kernel is built (cuDNN refuses empty tensors) and
the only writes are those zeros, respecting the operands' strides: queued on the call's
stream on NVIDIA (no sync, so a CUDA graph can capture it), by the host on the CPU.
"""

from typing import NamedTuple

from ..backends import cuda
from ..backends.host import host_array
from ..enums import Device
from ..tensor import ITEMSIZE, TensorDesc


class EmptyProblem:
    """Writes zeros into ``zeroed`` (per-channel outputs by name); runs nothing else."""

    engine = "empty"
    workspace_size = 0
    reserve_size = 0

    def __init__(self, zeroed: dict[str, TensorDesc], device: Device, device_id: int) -> None:
        self.zeroed, self.device, self.device_id = zeroed, device, device_id

    def run(self, ptrs: NamedTuple, workspace: int, stream: int) -> None:
        for name, desc in self.zeroed.items():
            ptr = getattr(ptrs, name)
            if self.device == Device.CPU:
                host_array(ptr, desc)[...] = 0
            else:
                itemsize = ITEMSIZE[desc.dtype]
                pitch = desc.strides[0] * itemsize
                cuda.zero_rows_async(ptr, pitch, itemsize, desc.shape[0], stream, self.device_id)
