"""cuDNN activation descriptors, for the fused batch-norm + ReLU passes."""

import ctypes

from .enums import ActivationMode, NanPropagation
from .library import cudnn
from .owned import Owned
from .prototypes import cudnnActivationDescriptor_t


class ActivationDescriptor(Owned):
    """A ``cudnnActivationDescriptor_t`` (ReLU by default, NaN propagated as PyTorch does)."""

    def __init__(self, mode: ActivationMode = ActivationMode.RELU, coef: float = 0.0) -> None:
        lib = cudnn()
        ref = cudnnActivationDescriptor_t()
        lib.cudnnCreateActivationDescriptor(ctypes.byref(ref))
        super().__init__(ref, lib.cudnnDestroyActivationDescriptor)
        try:
            lib.cudnnSetActivationDescriptor(self, mode, NanPropagation.PROPAGATE_NAN, coef)
        except BaseException:
            self.close()
            raise
