"""The NVIDIA backend: cuDNN first, CuPy kernels for the rest; the engine is chosen once.

* ``cudnn`` (``cudnn_engines.py``): F16/F32/F64 data of 3 to 5 dimensions whose operands
  share one packed layout (NCHW or channels-last) with fewer than 2^31 elements (cuDNN
  indexes with 32 bits), and, for backward, the train and saved modes; any eps
  (``CUDNN_BN_MIN_EPSILON`` is 0 since cuDNN 7.6). Fused passes (BN+ReLU, BN+Add+ReLU) only
  where cuDNN's fused kernels run: F16 NHWC data in SPATIAL_PERSISTENT mode (BN+Add+ReLU
  also C % 4 == 0; cuDNN 8.2 lifted that for BN+ReLU), and a fused backward only from saved
  statistics and the forward's reserve. A backward runs in SPATIAL_PERSISTENT only from
  both (``backward_bn_mode``: cuDNN wants saved statistics there, and its kernels read the
  reserve); otherwise in SPATIAL.
* ``cupy`` (``cupy_engines.py``): everything else — eval-mode backward (cuDNN has no call
  for it), BF16 data (PyTorch never sends BF16 to cuDNN's batch norm), 2-D input (cuDNN's
  PER_ACTIVATION mode, which PyTorch no longer uses), other strides, huge tensors; and every
  problem when libcudnn cannot load (with a warning).

Neither allocates nor synchronizes in ``run``: scratch lives in the caller's workspace.
"""

from typing import Any

from .._cudnn.enums import BatchNormMode
from .._cudnn.library import cudnn_loads
from ..enums import DataType
from ..problems import (
    BackwardAttributes,
    BackwardTensors,
    ForwardInferenceAttributes,
    ForwardInferenceTensors,
    ForwardTrainingAttributes,
    ForwardTrainingTensors,
    Fusion,
    Mode,
)
from ..tensor import TensorDesc
from . import cuda
from .cudnn_engines import (
    CudnnBatchNormBackward,
    CudnnBatchNormForwardInference,
    CudnnBatchNormForwardTraining,
    backward_bn_mode,
    bn_mode,
)
from .cupy_engines import (
    CupyBatchNormBackward,
    CupyBatchNormForwardInference,
    CupyBatchNormForwardTraining,
)

CUDNN_MAX_NUMEL, MIN_CUDNN_NDIM = 2**31 - 1, 3
CUDNN_MAX_BATCH_TRAINING, CUDNN_MAX_BATCH_INFERENCE = 880801, 65535
CUDNN_BACKWARD_MODES = (Mode.TRAIN, Mode.SAVED, Mode.SAVED_INVSTD)
CUDNN_DTYPES = (DataType.F16, DataType.F32, DataType.F64)
FUSED_CHANNEL_MULTIPLE, FUSED_NDIM = 4, 4


def _layout(desc: TensorDesc) -> str | None:
    if desc.is_contiguous():
        return "NCHW"
    return "NHWC" if desc.is_channels_last() else None


def cudnn_takes(
    data: list[TensorDesc], fusion: Fusion, mode: BatchNormMode, training: bool
) -> bool:
    """Whether cuDNN's batch-norm calls serve a problem whose ``(N, C, ...)`` operands are
    ``data`` (the input first) exactly. The guards are PyTorch's
    (``_select_batch_norm_backend`` in aten/src/ATen/native/Normalization.cpp): 3-D input or
    more (2-D would be PER_ACTIVATION, about 12x slower than PyTorch's own kernels and refused
    by older cuDNN above N = 131070: PyTorch PR 57034, issue 2917), fewer than 2^31 - 1
    elements (32-bit indexing), and at most 880801 samples in training, 65535 in inference
    (cuDNN's grid limits)."""
    x = data[0]
    layouts = {_layout(d) for d in data}
    if not (
        x.dtype in CUDNN_DTYPES
        and x.ndim >= MIN_CUDNN_NDIM
        and x.numel < CUDNN_MAX_NUMEL
        and x.shape[0] <= (CUDNN_MAX_BATCH_TRAINING if training else CUDNN_MAX_BATCH_INFERENCE)
        and len(layouts) == 1
        and None not in layouts
        and cudnn_loads()
    ):
        return False
    return fusion == Fusion.BN or (
        x.dtype == DataType.F16
        and x.ndim == FUSED_NDIM
        and layouts == {"NHWC"}
        and (fusion != Fusion.BN_ADD_RELU or x.shape[1] % FUSED_CHANNEL_MULTIPLE == 0)
        and mode == BatchNormMode.SPATIAL_PERSISTENT
    )


def _build(engine: type, tensors: Any, attributes: Any, device_id: int) -> Any:
    with cuda.on_device(device_id):
        return engine(tensors, attributes, device_id)


def BatchNormBackward(
    tensors: BackwardTensors, attributes: BackwardAttributes, device_id: int
) -> Any:
    """The backward engine for this problem on NVIDIA device ``device_id``."""
    a, t = attributes, tensors
    data = [d for d in (t.input, t.grad_output, t.grad_input, t.output, t.grad_z) if d is not None]
    # SPATIAL_PERSISTENT, the only mode of cuDNN's fused kernels, only from the forward's
    # saved statistics and reserve (``backward_bn_mode``): a fused backward without them
    # goes to the CuPy engine, which reads the ReLU mask from y.
    mode = backward_bn_mode(t.input, a)
    use_cudnn = a.mode in CUDNN_BACKWARD_MODES and cudnn_takes(data, a.fusion, mode, training=True)
    return _build(CudnnBatchNormBackward if use_cudnn else CupyBatchNormBackward, t, a, device_id)


def BatchNormForwardTraining(
    tensors: ForwardTrainingTensors, attributes: ForwardTrainingAttributes, device_id: int
) -> Any:
    """The training-forward engine for this problem on NVIDIA device ``device_id``."""
    a, t = attributes, tensors
    data = [d for d in (t.input, t.output, t.z) if d is not None]
    use_cudnn = cudnn_takes(data, a.fusion, bn_mode(t.input, True, a.persistent), training=True)
    return _build(
        CudnnBatchNormForwardTraining if use_cudnn else CupyBatchNormForwardTraining,
        t,
        a,
        device_id,
    )


def BatchNormForwardInference(
    tensors: ForwardInferenceTensors, attributes: ForwardInferenceAttributes, device_id: int
) -> Any:
    """The inference-forward engine for this problem on NVIDIA device ``device_id``."""
    t = tensors
    mode = bn_mode(t.input, False, False)
    use_cudnn = cudnn_takes([t.input, t.output], Fusion.BN, mode, training=False)
    engine = CudnnBatchNormForwardInference if use_cudnn else CupyBatchNormForwardInference
    return _build(engine, t, attributes, device_id)
