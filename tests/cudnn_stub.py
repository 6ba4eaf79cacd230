"""A stub libcudnn that holds the package to cuDNN's documented contract, without a GPU;
shared by the tests of the NVIDIA path (grep ``cudnn_stub``).

The stub, compiled from the C below, exports every function of the prototype table with
cuDNN's C signatures. It keeps tensor and activation descriptors well enough to be set,
derived and read back (and counts the live ones), reports workspace and reserve sizes the
tests may change, and records the arguments of the last ``cudnnSetStream``, size query and
batch-norm call, one record struct per function (generated from the ctypes mirrors here, so
the two cannot disagree). Before it answers SUCCESS, every call is checked against the
preconditions cuDNN documents for it (the table below): a broken one returns cuDNN's status
and ``cudnnGetLastErrorString`` names the rule ("broke rule persistent-saved"). ``install``
makes it the process's libcudnn, with an empty handle pool, and stands in for the CUDA seam
(``cudnn_bn.backends.cuda``: device 0 current, one device). On the cuDNN fast path
(per-channel tensors already in cuDNN's dtype with stride 1) nothing touches CuPy, so
``stream_scope`` fails the test if it is entered.

Rules (``CHECK(..., rule)`` in the C; ``test_cudnn_stub_contract.py`` holds the two to each
other). [h]: the sentence is in cuDNN 9.28's own headers (``cudnn_ops.h``, ``cudnn_graph.h``
of the nvidia-cudnn-cu12 wheel); [d]: the cuDNN 9 API reference (cudnn_ops library), from the
parameter lists and "returns" lists of cudnnBatchNormalizationForwardInference,
cudnnBatchNormalizationForwardTraining(Ex), cudnnBatchNormalizationBackward(Ex),
cudnnCreate and cudnnSetStream; [i]: quoted in issue 19; [s]: the stub's own strengthening,
where cuDNN states the need but no status (the status is then the nearest cuDNN 9 one).

tensor-dims: 2000 BAD_PARAM
    cudnnSetTensorNdDescriptor: "At least one of the elements of the array dimA was negative
    or zero" [d] (strides: negative ones likewise)
tensor-rank: 3000 NOT_SUPPORTED
    cudnnSetTensorNdDescriptor: "The parameter nbDims is outside the range [4,
    CUDNN_DIM_MAX], or the total size of the tensor descriptor exceeds the maximum limit of 2
    Giga-elements" [d]
handle-device: 5000 EXECUTION_FAILED [s]
    cudnnCreate: "The cuDNN library handle is tied to the current CUDA device (context)" [d]
stream-set: 2007 BAD_PARAM_STREAM_MISMATCH [s]
    cudnnSetStream: "If the cuDNN library stream is not set, all kernels use the default
    (NULL) stream" [d]: the package sets it before every call (a pooled handle serves many
    streams)
rank: 2000 BAD_PARAM
    "The number of xDesc or yDesc or dxDesc tensor descriptor dimensions is not within the
    range of [4,5] (only 4D and 5D tensors are supported)" [d];
    cudnnDeriveBNTensorDescriptor likewise
same-dims: 2000 BAD_PARAM
    "Dimensions or data types mismatch for any pair of xDesc, dyDesc, dxDesc" (backward),
    "for xDesc, yDesc" (forward) [d]
bn-desc: 2000 BAD_PARAM
    "bnScaleBiasMeanVarDesc dimensions are not 1xCx1x1 for spatial or 1xCxHxW for 4D per-
    activation" [d]; its type: "type = (typeOf(x) == double) ? double : float" [h]
non-null: 2000 BAD_PARAM
    "Any of the pointers alpha, beta, x, dy, dx, bnScale, resultBnScaleDiff,
    resultBnBiasDiff is NULL" (backward); "One of the pointers alpha, beta, x, y, bnScale,
    bnBias is NULL" (forward; inference adds estimatedMean, estimatedInvVariance) [d]
alpha-beta: 2000 BAD_PARAM [s]
    "alpha, beta: Pointers to scaling factors (in host memory)": float for HALF and FLOAT
    data, double for DOUBLE [d]; read as that type they must be the package's 1 and 0 (a
    float read as a double is not)
saved-pair: 2000 BAD_PARAM
    "Exactly one of savedMean, savedInvVariance pointers is NULL" [d]
    (resultSaveMean/resultSaveInvVariance in the forward)
running-pair: 2000 BAD_PARAM
    "Exactly one of resultRunningMean, resultRunningInvVariance pointers are NULL" [d]
persistent-saved: 2000 BAD_PARAM
    CUDNN_BATCHNORM_SPATIAL_PERSISTENT: "In the case of cudnnBatchNormalizationBackward(),
    the savedMean and savedInvVariance arguments should not be NULL" [i][d]
epsilon: 2000 BAD_PARAM
    "epsilon value is less than CUDNN_BN_MIN_EPSILON" [d]; "Has to be >=
    CUDNN_BN_MIN_EPSILON" [h]
add-operand: 2000 BAD_PARAM
    bnOps BN_ADD_ACTIVATION: "zDesc, zData: ... the tensor descriptor and data for the
    residual addition"; dz likewise in the backward [d]
fused-operands: 2000 BAD_PARAM
    backward "bnBiasData: ... needed for activation" [h]; "yDesc, yData: ... the output of
    the forward" for bnOps != BN [d]
fused-activation: 2000 BAD_PARAM
    "activationDesc: ... the activation operation. When bnOps is BN only, it is ignored"
    [d]: ReLU, the one the fused kernels implement
fused-mode: 3000 NOT_SUPPORTED
    the fused (NHWC semi-persistent) path: "The input parameter mode must be set to
    CUDNN_BATCHNORM_SPATIAL_PERSISTENT" [d]
fused-dtype: 3003 NOT_SUPPORTED_DATA_TYPE
    "All the tensors, that is, x, y, dz, dy, dx must be NHWC-fully packed, and must be of
    the type CUDNN_DATA_HALF" [d]
fused-layout: 3004 NOT_SUPPORTED_LAYOUT
    the same sentence: NHWC fully packed (4-D)
fused-add-channels: 3000 NOT_SUPPORTED
    "The tensor C dimension should be a multiple of 4" [d], kept for BN_ADD_ACTIVATION only
    (the package's rule since cuDNN 8.2)
workspace-queried: 2000 BAD_PARAM
    fast paths: "workspace is not NULL"; "If workspace is NULL and workSpaceSizeInBytes of
    zero is passed in, this API will function exactly like the non-extended function" [d]
workspace-size: 2006 BAD_PARAM_SIZE_INSUFFICIENT
    "workSpaceSizeInBytes is equal to or larger than the amount required by
    cudnnGetBatchNormalization...WorkspaceSize()" [d], per mode and bnOps asked for this
    xDesc
reserve-needed: 2000 BAD_PARAM
    fast paths and fused ops: the reserve is "used to store values needed during backward"
    [d]
reserve-size: 2006 BAD_PARAM_SIZE_INSUFFICIENT
    "reserveSpaceSizeInBytes is equal to or larger than the amount required by
    cudnnGetBatchNormalizationTrainingExReserveSpaceSize()" [d]
reserve-from-forward: 2000 BAD_PARAM
    "The content in reserveSpace stored by cudnnBatchNormalizationForwardTrainingEx() must
    be preserved" [d]: a backward's reserve comes from a forward of the same mode, bnOps and
    x
aligned: 2003 BAD_PARAM_MISALIGNED_POINTER
    "Misaligned pointer passed" [h]: each data pointer aligned to its element size (CUDA's
    natural alignment)
workspace-aligned, reserve-aligned: 2003 BAD_PARAM_MISALIGNED_POINTER [s]
    as above; 16 bytes, what every CUDA allocator gives

Below the stub: fake device pointers and the layouts cuDNN must be told.
"""

import ctypes
import functools
import shutil
import subprocess
import threading
from ctypes import c_double, c_int64, c_size_t, c_ssize_t, c_uint64, c_void_p
from pathlib import Path
from typing import Any

import pytest
from helpers import SHAPES, channels_last

from cudnn_bn import DataType, Status, TensorDesc, capi
from cudnn_bn import runtime as runtime_module
from cudnn_bn._cudnn import handle as handle_module
from cudnn_bn._cudnn import library as library_module
from cudnn_bn._cudnn.library import CudnnLibrary
from cudnn_bn._cudnn.loader import CudnnInfo
from cudnn_bn.backends import cuda
from cudnn_bn.tensor import contiguous_strides

F16, BF16, F32, F64 = DataType.F16, DataType.BF16, DataType.F32, DataType.F64
# cuDNN's enum values, written out as its headers have them.
CUDNN_FLOAT, CUDNN_DOUBLE, CUDNN_HALF = 0, 1, 2  # cudnnDataType_t
CUDNN_TYPE = {F16: CUDNN_HALF, F32: CUDNN_FLOAT, F64: CUDNN_DOUBLE}
PER_ACTIVATION, SPATIAL, SPATIAL_PERSISTENT = 0, 1, 2  # cudnnBatchNormMode_t
OPS_BN, OPS_BN_ACTIVATION, OPS_BN_ADD_ACTIVATION = 0, 1, 2  # cudnnBatchNormOps_t
ACTIVATION_RELU, PROPAGATE_NAN = 1, 1  # cudnnActivationMode_t, cudnnNanPropagation_t

STUB_VERSION = 92800
STUB_WORKSPACE = 4096  # bytes the stub's workspace queries report unless a test changes it
STUB_RESERVE = 512  # bytes its reserve query reports unless a test changes it

# --- records of the calls -------------------------------------------------------------------

# Every record field is 8 bytes wide, so the C struct and its ctypes mirror cannot disagree
# on padding; the C structs are generated from the ctypes ones below. A call record's
# ``status`` is an input: what the stub's function returns (0 after ``reset``).
DOUBLE_FIELDS = {
    "alpha", "beta", "alpha_data", "beta_data", "alpha_param", "beta_param", "epsilon",
    "exponential_average_factor",
}  # fmt: skip


def _fields(names: str) -> list[tuple[str, type]]:
    return [(name, c_double if name in DOUBLE_FIELDS else c_uint64) for name in names.split()]


class StreamCall(ctypes.Structure):
    _fields_ = _fields("calls handle stream")


class RuntimeErrorQuery(ctypes.Structure):
    """``cudnnQueryRuntimeError``'s arguments; ``rstatus`` is an input: what it reports."""

    _fields_ = _fields("calls handle mode tag rstatus")


class BackwardWorkspaceQuery(ctypes.Structure):
    """``cudnnGetBatchNormalizationBackwardExWorkspaceSize``'s arguments."""

    _fields_ = _fields(
        "calls handle mode bn_ops x_desc y_desc dy_desc dz_desc dx_desc bn_desc activation_desc"
    )


class ForwardWorkspaceQuery(ctypes.Structure):
    """``cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize``'s arguments."""

    _fields_ = _fields("calls handle mode bn_ops x_desc z_desc y_desc bn_desc activation_desc")


class ReserveQuery(ctypes.Structure):
    """``cudnnGetBatchNormalizationTrainingExReserveSpaceSize``'s arguments."""

    _fields_ = _fields("calls handle mode bn_ops activation_desc x_desc")


class BackwardCall(ctypes.Structure):
    """``cudnnBatchNormalizationBackwardEx``'s arguments in order; alpha/beta are the values
    behind the pointers, read as double for DOUBLE data and as float otherwise."""

    _fields_ = _fields(
        "calls status handle mode bn_ops alpha_data beta_data alpha_param beta_param"
        " x_desc x y_desc y dy_desc dy dz_desc dz dx_desc dx"
        " bn_desc scale bias dscale dbias epsilon saved_mean saved_inv_variance"
        " activation_desc workspace workspace_size reserve reserve_size"
    )


class ForwardTrainingCall(ctypes.Structure):
    """``cudnnBatchNormalizationForwardTrainingEx``'s arguments in order (alpha/beta as in
    ``BackwardCall``)."""

    _fields_ = _fields(
        "calls status handle mode bn_ops alpha beta x_desc x z_desc z y_desc y"
        " bn_desc scale bias exponential_average_factor running_mean running_var epsilon"
        " save_mean save_inv_variance activation_desc workspace workspace_size"
        " reserve reserve_size"
    )


class ForwardInferenceCall(ctypes.Structure):
    """``cudnnBatchNormalizationForwardInference``'s arguments in order."""

    _fields_ = _fields(
        "calls status handle mode alpha beta x_desc x y_desc y"
        " bn_desc scale bias estimated_mean estimated_variance epsilon"
    )


# What the stub records, by the name of its C global (``stub_<name>``) and ``Stub`` attribute.
RECORDS = {
    "set_stream": StreamCall,
    "runtime_error": RuntimeErrorQuery,
    "backward_query": BackwardWorkspaceQuery,
    "forward_query": ForwardWorkspaceQuery,
    "reserve_query": ReserveQuery,
    "backward": BackwardCall,
    "forward_training": ForwardTrainingCall,
    "forward_inference": ForwardInferenceCall,
}


class TensorRecord(ctypes.Structure):
    """The stub's ``struct cudnnTensorStruct``, all 8-byte fields."""

    _fields_ = [  # set: 0 never set, 1 set, -1 destroyed
        ("set", c_int64), ("dtype", c_int64), ("nb_dims", c_int64), ("derive_mode", c_int64),
        ("derived_from", c_uint64), ("dims", c_int64 * 8), ("strides", c_int64 * 8),
    ]  # fmt: skip


class ActivationRecord(ctypes.Structure):
    """The stub's ``struct cudnnActivationStruct``: what ``cudnnSetActivationDescriptor`` set."""

    _fields_ = [  # set: 0 never set, 1 set, -1 destroyed
        ("set", c_int64), ("mode", c_int64), ("nan_opt", c_int64), ("coef", c_double),
    ]  # fmt: skip


def _c_struct(record: type[ctypes.Structure]) -> str:
    members = " ".join(
        f"{'double' if ctype is c_double else 'uint64_t'} {name};"
        for name, ctype in record._fields_
    )
    return f"typedef struct {{ {members} }} {record.__name__};\n"


STUB_PRELUDE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudnnStatus_t;
typedef int cudnnDataType_t;
typedef int cudnnBatchNormMode_t;
typedef int cudnnBatchNormOps_t;
typedef int cudnnActivationMode_t;
typedef int cudnnNanPropagation_t;
typedef int cudnnErrQueryMode_t;
typedef struct cudnnRuntimeTag_t cudnnRuntimeTag_t;
typedef void *cudaStream_t;
typedef struct cudnnContext *cudnnHandle_t;
typedef struct cudnnTensorStruct *cudnnTensorDescriptor_t;
typedef struct cudnnActivationStruct *cudnnActivationDescriptor_t;
"""

# The stub's declarations, as cuDNN's headers spell them (a test compares the two); the C
# compiler holds the definitions below to them.
STUB_DECLARATIONS = r"""
size_t cudnnGetVersion(void);
size_t cudnnGetCudartVersion(void);
const char *cudnnGetErrorString(cudnnStatus_t status);
void cudnnGetLastErrorString(char *message, size_t max_size);
cudnnStatus_t cudnnCreate(cudnnHandle_t *handle);
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle);
cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId);
cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t *streamId);
cudnnStatus_t cudnnQueryRuntimeError(cudnnHandle_t handle, cudnnStatus_t *rstatus,
    cudnnErrQueryMode_t mode, cudnnRuntimeTag_t *tag);
cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *tensorDesc);
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t tensorDesc);
cudnnStatus_t cudnnSetTensorNdDescriptor(cudnnTensorDescriptor_t tensorDesc,
    cudnnDataType_t dataType, int nbDims, const int dimA[], const int strideA[]);
cudnnStatus_t cudnnGetTensorNdDescriptor(const cudnnTensorDescriptor_t tensorDesc,
    int nbDimsRequested, cudnnDataType_t *dataType, int *nbDims, int dimA[], int strideA[]);
cudnnStatus_t cudnnCreateActivationDescriptor(cudnnActivationDescriptor_t *activationDesc);
cudnnStatus_t cudnnSetActivationDescriptor(cudnnActivationDescriptor_t activationDesc,
    cudnnActivationMode_t mode, cudnnNanPropagation_t reluNanOpt, double coef);
cudnnStatus_t cudnnDestroyActivationDescriptor(cudnnActivationDescriptor_t activationDesc);
cudnnStatus_t cudnnDeriveBNTensorDescriptor(cudnnTensorDescriptor_t derivedBnDesc,
    const cudnnTensorDescriptor_t xDesc, cudnnBatchNormMode_t mode);
cudnnStatus_t cudnnBatchNormalizationForwardInference(cudnnHandle_t handle,
    cudnnBatchNormMode_t mode, const void *alpha, const void *beta,
    const cudnnTensorDescriptor_t xDesc, const void *x, const cudnnTensorDescriptor_t yDesc,
    void *y, const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
    const void *bnBias, const void *estimatedMean, const void *estimatedVariance,
    double epsilon);
cudnnStatus_t cudnnBatchNormalizationForwardTraining(cudnnHandle_t handle,
    cudnnBatchNormMode_t mode, const void *alpha, const void *beta,
    const cudnnTensorDescriptor_t xDesc, const void *x, const cudnnTensorDescriptor_t yDesc,
    void *y, const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
    const void *bnBias, double exponentialAverageFactor, void *resultRunningMean,
    void *resultRunningVariance, double epsilon, void *resultSaveMean,
    void *resultSaveInvVariance);
cudnnStatus_t cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(cudnnHandle_t handle,
    cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const cudnnTensorDescriptor_t xDesc,
    const cudnnTensorDescriptor_t zDesc, const cudnnTensorDescriptor_t yDesc,
    const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc,
    const cudnnActivationDescriptor_t activationDesc, size_t *sizeInBytes);
cudnnStatus_t cudnnGetBatchNormalizationBackwardExWorkspaceSize(cudnnHandle_t handle,
    cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const cudnnTensorDescriptor_t xDesc,
    const cudnnTensorDescriptor_t yDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnTensorDescriptor_t dzDesc, const cudnnTensorDescriptor_t dxDesc,
    const cudnnTensorDescriptor_t dBnScaleBiasDesc,
    const cudnnActivationDescriptor_t activationDesc, size_t *sizeInBytes);
cudnnStatus_t cudnnGetBatchNormalizationTrainingExReserveSpaceSize(cudnnHandle_t handle,
    cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps,
    const cudnnActivationDescriptor_t activationDesc, const cudnnTensorDescriptor_t xDesc,
    size_t *sizeInBytes);
cudnnStatus_t cudnnBatchNormalizationForwardTrainingEx(cudnnHandle_t handle,
    cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const void *alpha, const void *beta,
    const cudnnTensorDescriptor_t xDesc, const void *xData,
    const cudnnTensorDescriptor_t zDesc, const void *zData,
    const cudnnTensorDescriptor_t yDesc, void *yData,
    const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
    const void *bnBias, double exponentialAverageFactor, void *resultRunningMean,
    void *resultRunningVariance, double epsilon, void *resultSaveMean,
    void *resultSaveInvVariance, cudnnActivationDescriptor_t activationDesc, void *workspace,
    size_t workSpaceSizeInBytes, void *reserveSpace, size_t reserveSpaceSizeInBytes);
cudnnStatus_t cudnnBatchNormalizationBackward(cudnnHandle_t handle, cudnnBatchNormMode_t mode,
    const void *alphaDataDiff, const void *betaDataDiff, const void *alphaParamDiff,
    const void *betaParamDiff, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnTensorDescriptor_t dxDesc,
    void *dx, const cudnnTensorDescriptor_t dBnScaleBiasDesc, const void *bnScale,
    void *dBnScaleResult, void *dBnBiasResult, double epsilon, const void *savedMean,
    const void *savedInvVariance);
cudnnStatus_t cudnnBatchNormalizationBackwardEx(cudnnHandle_t handle,
    cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const void *alphaDataDiff,
    const void *betaDataDiff, const void *alphaParamDiff, const void *betaParamDiff,
    const cudnnTensorDescriptor_t xDesc, const void *xData,
    const cudnnTensorDescriptor_t yDesc, const void *yData,
    const cudnnTensorDescriptor_t dyDesc, const void *dyData,
    const cudnnTensorDescriptor_t dzDesc, void *dzData,
    const cudnnTensorDescriptor_t dxDesc, void *dxData,
    const cudnnTensorDescriptor_t dBnScaleBiasDesc, const void *bnScaleData,
    const void *bnBiasData, void *dBnScaleData, void *dBnBiasData, double epsilon,
    const void *savedMean, const void *savedInvVariance,
    cudnnActivationDescriptor_t activationDesc, void *workSpace, size_t workSpaceSizeInBytes,
    void *reserveSpace, size_t reserveSpaceSizeInBytes);
"""


STUB_DEFINITIONS = r"""
#define MAX_DIMS 8
#define BAD_PARAM 2000
#define NULL_POINTER 2002
#define MISALIGNED_POINTER 2003
#define SIZE_INSUFFICIENT 2006
#define STREAM_MISMATCH 2007
#define SHAPE_MISMATCH 2008
#define NOT_SUPPORTED 3000
#define NOT_SUPPORTED_DATA_TYPE 3003
#define NOT_SUPPORTED_LAYOUT 3004
#define EXECUTION_FAILED 5000
#define U(p) ((uint64_t)(uintptr_t)(p))
#define HALF 2
#define DOUBLE 1
#define PERSISTENT 2
#define OPS_BN 0
#define OPS_ADD 2
#define RELU 1
#define WORKSPACE_ALIGNMENT 16
#define RESERVES 256

/* A handle: its stream, whether cudnnSetStream ran since its last call, its device. */
struct cudnnContext { cudaStream_t stream; int64_t stream_set, device; };
/* What the ctypes TensorRecord mirrors, then what the size queries answered for this
   descriptor as xDesc, by [mode][bnOps] (-1: never asked). */
struct cudnnTensorStruct {
    int64_t set, dtype, nb_dims, derive_mode;
    uint64_t derived_from;
    int64_t dims[MAX_DIMS], strides[MAX_DIMS];
    int64_t forward_workspace[3][3], backward_workspace[3][3], reserve[3][3];
};
/* A reserve space a forward filled: for which mode, bnOps, x dims and data type. */
typedef struct { uint64_t ptr; int64_t mode, ops, dtype, nb_dims, dims[MAX_DIMS]; } Reserve;
struct cudnnActivationStruct { int64_t set, mode, nan_opt; double coef; };

StreamCall stub_set_stream;
RuntimeErrorQuery stub_runtime_error;
BackwardWorkspaceQuery stub_backward_query;
ForwardWorkspaceQuery stub_forward_query;
ReserveQuery stub_reserve_query;
BackwardCall stub_backward;
ForwardTrainingCall stub_forward_training;
ForwardInferenceCall stub_forward_inference;
uint64_t stub_workspace_bytes = 4096;  /* what both workspace queries report */
uint64_t stub_reserve_bytes = 512;     /* what the reserve query reports */
int64_t stub_live_tensors;             /* created minus destroyed tensor descriptors */
int64_t stub_live_activations;         /* created minus destroyed activation descriptors */
int64_t stub_device;                   /* the CUDA device current now (the tests set it) */
static Reserve reserves[RESERVES];     /* filled by forwards, read by backwards */
static int last_status;
static const char *last_rule = "";

static cudnnStatus_t fail(cudnnStatus_t status) {
    last_status = status;
    last_rule = "";
    return status;
}

/* A broken precondition: cuDNN's status, and the rule (RULES in cudnn_stub.py) for the
   message cudnnGetLastErrorString gives. */
static cudnnStatus_t refuse(cudnnStatus_t status, const char *rule) {
    last_status = status;
    last_rule = rule;
    return status;
}

#define CHECK(ok, status, rule) do { if (!(ok)) return refuse(status, rule); } while (0)

static int set(const struct cudnnTensorStruct *t) { return t != NULL && t->set == 1; }
static int rank_4_or_5(const struct cudnnTensorStruct *t) {
    return set(t) && (t->nb_dims == 4 || t->nb_dims == 5);
}
/* The same data type and dimensions (strides may differ). */
static int alike(const struct cudnnTensorStruct *a, const struct cudnnTensorStruct *b) {
    if (!set(a) || !set(b) || a->dtype != b->dtype || a->nb_dims != b->nb_dims) return 0;
    for (int i = 0; i < a->nb_dims; i++)
        if (a->dims[i] != b->dims[i]) return 0;
    return 1;
}
/* 1xCx1x1 (SPATIAL modes) or 1xCxHxW (PER_ACTIVATION), DOUBLE for DOUBLE data, else FLOAT. */
static int bn_of(const struct cudnnTensorStruct *bn, const struct cudnnTensorStruct *x, int mode) {
    if (!set(bn) || bn->nb_dims != x->nb_dims) return 0;
    if (bn->dtype != (x->dtype == DOUBLE ? DOUBLE : 0)) return 0;
    for (int i = 0; i < x->nb_dims; i++) {
        int64_t want = i == 0 ? 1 : (i == 1 || mode == 0) ? x->dims[i] : 1;
        if (bn->dims[i] != want) return 0;
    }
    return 1;
}
/* NHWC fully packed: C innermost, then W, H, N. */
static int nhwc_packed(const struct cudnnTensorStruct *t) {
    if (!set(t) || t->nb_dims != 4) return 0;
    const int64_t *d = t->dims, *st = t->strides;
    return st[1] == 1 && st[3] == d[1] && st[2] == d[1] * d[3] && st[0] == d[1] * d[2] * d[3];
}
static int64_t element_size(int64_t dtype) { return dtype == DOUBLE ? 8 : dtype == HALF ? 2 : 4; }
static int aligned(const void *p, int64_t to) { return U(p) % (uint64_t)to == 0; }
static int both_or_neither(const void *a, const void *b) { return (a == NULL) == (b == NULL); }
static int valid_mode(int mode, int ops) { return mode >= 0 && mode <= 2 && ops >= 0 && ops <= 2; }

/* The handle is used on the device it was made on, with its stream set for this call. */
static cudnnStatus_t use_handle(cudnnHandle_t handle) {
    if (handle == NULL) return fail(NULL_POINTER);
    CHECK(handle->device == stub_device, EXECUTION_FAILED, "handle-device");
    return 0;
}
static cudnnStatus_t launch(cudnnHandle_t handle) {
    cudnnStatus_t status = use_handle(handle);
    if (status) return status;
    CHECK(handle->stream_set, STREAM_MISMATCH, "stream-set");
    handle->stream_set = 0;
    return 0;
}

/* The fused ops' rules: SPATIAL_PERSISTENT, HALF, 4-D NHWC fully packed, C % 4 == 0 with
   the add, a ReLU activation descriptor. */
static cudnnStatus_t fused_ok(int mode, int ops, const struct cudnnTensorStruct *x,
        const struct cudnnActivationStruct *activation) {
    if (ops == OPS_BN) return 0;
    CHECK(activation != NULL && activation->set == 1 && activation->mode == RELU, BAD_PARAM,
          "fused-activation");
    CHECK(mode == PERSISTENT, NOT_SUPPORTED, "fused-mode");
    CHECK(x->dtype == HALF, NOT_SUPPORTED_DATA_TYPE, "fused-dtype");
    CHECK(nhwc_packed(x), NOT_SUPPORTED_LAYOUT, "fused-layout");
    CHECK(ops != OPS_ADD || x->dims[1] % 4 == 0, NOT_SUPPORTED, "fused-add-channels");
    return 0;
}

/* The workspace: NULL with size 0, or aligned and as large as the query answered; the fast
   paths (SPATIAL_PERSISTENT, fused) need it where the query answered more than 0. */
static cudnnStatus_t workspace_ok(const void *workspace, size_t size, int64_t answered,
        int fast) {
    if (workspace == NULL && size == 0 && (!fast || answered == 0)) return 0;
    CHECK(workspace != NULL && answered >= 0, BAD_PARAM, "workspace-queried");
    CHECK((int64_t)size >= answered, SIZE_INSUFFICIENT, "workspace-size");
    CHECK(aligned(workspace, WORKSPACE_ALIGNMENT), MISALIGNED_POINTER, "workspace-aligned");
    return 0;
}

static Reserve *find_reserve(const void *ptr) {
    for (int i = 0; i < RESERVES; i++)
        if (reserves[i].ptr == U(ptr)) return &reserves[i];
    return NULL;
}

/* Record that a forward (or a test standing in for one) filled ``ptr`` for x, mode, ops. */
int stub_fill_reserve(uint64_t ptr, const struct cudnnTensorStruct *x, int64_t mode,
        int64_t ops) {
    Reserve *r = find_reserve((const void *)(uintptr_t)ptr);
    if (r == NULL) r = find_reserve(NULL);
    if (r == NULL || !set(x)) return 1;
    r->ptr = ptr; r->mode = mode; r->ops = ops; r->dtype = x->dtype; r->nb_dims = x->nb_dims;
    for (int i = 0; i < x->nb_dims; i++) r->dims[i] = x->dims[i];
    return 0;
}

void stub_forget_reserves(void) { memset(reserves, 0, sizeof reserves); }

/* A reserve, where one is needed (SPATIAL_PERSISTENT, fused, and the query answered more
   than 0) or given: as large as the query answered, and, for a backward, filled by a forward
   of the same mode, ops and x. */
static cudnnStatus_t reserve_ok(const void *reserve, size_t size, int64_t answered, int needed,
        int backward, int mode, int ops, const struct cudnnTensorStruct *x) {
    if (reserve == NULL && (!needed || answered == 0)) return 0;
    CHECK(reserve != NULL && answered >= 0, BAD_PARAM, "reserve-needed");
    CHECK((int64_t)size >= answered, SIZE_INSUFFICIENT, "reserve-size");
    CHECK(aligned(reserve, WORKSPACE_ALIGNMENT), MISALIGNED_POINTER, "reserve-aligned");
    if (!backward) return 0;
    const Reserve *r = find_reserve(reserve);
    int same = r != NULL && r->mode == mode && r->ops == ops && r->dtype == x->dtype
        && r->nb_dims == x->nb_dims;
    for (int i = 0; same && i < x->nb_dims; i++) same = r->dims[i] == x->dims[i];
    CHECK(same, BAD_PARAM, "reserve-from-forward");
    return 0;
}

/* What a recorded call returns: the status its record was told to, failing with it. */
static cudnnStatus_t answer(uint64_t status) { return status ? fail((int)status) : 0; }

/* An alpha/beta scaling factor: double for DOUBLE data, float otherwise, as cuDNN reads it. */
static double scaling(const void *p, cudnnTensorDescriptor_t x) {
    if (p == NULL) return -1e300;
    return x != NULL && x->dtype == 1 ? *(const double *)p : (double)*(const float *)p;
}

/* The package never blends: alpha 1 and beta 0, read as cuDNN reads them. */
static int one_and_zero(const void *alpha, const void *beta, cudnnTensorDescriptor_t x) {
    return scaling(alpha, x) == 1.0 && scaling(beta, x) == 0.0;
}

size_t cudnnGetVersion(void) { return 92800; }
size_t cudnnGetCudartVersion(void) { return 12080; }

const char *cudnnGetErrorString(cudnnStatus_t status) {
    static char text[64];
    snprintf(text, sizeof text, "STUB_STATUS_%d", status);
    return text;
}

void cudnnGetLastErrorString(char *message, size_t max_size) {
    if (message == NULL || max_size == 0) return;
    if (last_status != 0)
        snprintf(message, max_size, "stub detail for %d%s%s", last_status,
                 *last_rule ? ": broke rule " : "", last_rule);
    else message[0] = 0;
}

cudnnStatus_t cudnnCreate(cudnnHandle_t *handle) {
    if (handle == NULL) return fail(NULL_POINTER);
    *handle = calloc(1, sizeof **handle);
    (*handle)->device = stub_device;
    return 0;
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
    if (handle == NULL) return fail(NULL_POINTER);
    free(handle);
    return 0;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId) {
    cudnnStatus_t status = use_handle(handle);
    if (status) return status;
    stub_set_stream.calls++;
    stub_set_stream.handle = U(handle);
    stub_set_stream.stream = U(streamId);
    handle->stream = streamId;
    handle->stream_set = 1;
    return 0;
}

cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t *streamId) {
    if (handle == NULL || streamId == NULL) return fail(NULL_POINTER);
    *streamId = handle->stream;
    return 0;
}

cudnnStatus_t cudnnQueryRuntimeError(cudnnHandle_t handle, cudnnStatus_t *rstatus,
        cudnnErrQueryMode_t mode, cudnnRuntimeTag_t *tag) {
    if (handle == NULL || rstatus == NULL) return fail(NULL_POINTER);
    RuntimeErrorQuery *q = &stub_runtime_error;
    q->calls++;
    q->handle = U(handle); q->mode = mode; q->tag = U(tag);
    *rstatus = (cudnnStatus_t)q->rstatus;
    return 0;
}

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *tensorDesc) {
    if (tensorDesc == NULL) return fail(NULL_POINTER);
    *tensorDesc = calloc(1, sizeof **tensorDesc);
    memset((*tensorDesc)->forward_workspace, 0xff, 3 * sizeof (*tensorDesc)->forward_workspace);
    stub_live_tensors++;
    return 0;
}

/* Kept, not freed, and marked destroyed: a test that reads it late fails clearly. */
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t tensorDesc) {
    if (tensorDesc != NULL) {
        tensorDesc->set = -1;
        stub_live_tensors--;
    }
    return 0;
}

cudnnStatus_t cudnnSetTensorNdDescriptor(cudnnTensorDescriptor_t tensorDesc,
        cudnnDataType_t dataType, int nbDims, const int dimA[], const int strideA[]) {
    if (tensorDesc == NULL || dimA == NULL || strideA == NULL) return fail(NULL_POINTER);
    CHECK(nbDims >= 4 && nbDims <= MAX_DIMS, NOT_SUPPORTED, "tensor-rank");
    int64_t numel = 1;
    for (int i = 0; i < nbDims; i++) {
        CHECK(dimA[i] > 0 && strideA[i] >= 0, BAD_PARAM, "tensor-dims");
        numel *= dimA[i];
    }
    CHECK(numel <= 2147483647, NOT_SUPPORTED, "tensor-rank");
    tensorDesc->set = 1;
    tensorDesc->dtype = dataType;
    tensorDesc->nb_dims = nbDims;
    tensorDesc->derive_mode = -1;
    tensorDesc->derived_from = 0;
    for (int i = 0; i < nbDims; i++) {
        tensorDesc->dims[i] = dimA[i];
        tensorDesc->strides[i] = strideA[i];
    }
    return 0;
}

cudnnStatus_t cudnnGetTensorNdDescriptor(const cudnnTensorDescriptor_t tensorDesc,
        int nbDimsRequested, cudnnDataType_t *dataType, int *nbDims, int dimA[], int strideA[]) {
    if (tensorDesc == NULL || dataType == NULL || nbDims == NULL) return fail(NULL_POINTER);
    if (tensorDesc->set != 1) return fail(BAD_PARAM);
    *dataType = (cudnnDataType_t)tensorDesc->dtype;
    *nbDims = (int)tensorDesc->nb_dims;
    for (int i = 0; i < tensorDesc->nb_dims && i < nbDimsRequested; i++) {
        dimA[i] = (int)tensorDesc->dims[i];
        strideA[i] = (int)tensorDesc->strides[i];
    }
    return 0;
}

cudnnStatus_t cudnnCreateActivationDescriptor(cudnnActivationDescriptor_t *activationDesc) {
    if (activationDesc == NULL) return fail(NULL_POINTER);
    *activationDesc = calloc(1, sizeof **activationDesc);
    stub_live_activations++;
    return 0;
}

cudnnStatus_t cudnnSetActivationDescriptor(cudnnActivationDescriptor_t activationDesc,
        cudnnActivationMode_t mode, cudnnNanPropagation_t reluNanOpt, double coef) {
    if (activationDesc == NULL) return fail(NULL_POINTER);
    if (activationDesc->set == -1) return fail(BAD_PARAM);
    activationDesc->set = 1;
    activationDesc->mode = mode;
    activationDesc->nan_opt = reluNanOpt;
    activationDesc->coef = coef;
    return 0;
}

/* Kept and marked destroyed, as tensor descriptors are. */
cudnnStatus_t cudnnDestroyActivationDescriptor(cudnnActivationDescriptor_t activationDesc) {
    if (activationDesc != NULL) {
        activationDesc->set = -1;
        stub_live_activations--;
    }
    return 0;
}

/* (1, C, 1, ...) for SPATIAL, (1, C, H, W, ...) for PER_ACTIVATION, packed; FLOAT
   statistics for HALF and BFLOAT16 data, the data type otherwise. */
cudnnStatus_t cudnnDeriveBNTensorDescriptor(cudnnTensorDescriptor_t derivedBnDesc,
        const cudnnTensorDescriptor_t xDesc, cudnnBatchNormMode_t mode) {
    if (derivedBnDesc == NULL || xDesc == NULL) return fail(NULL_POINTER);
    CHECK(rank_4_or_5(xDesc) && mode >= 0 && mode <= 2, BAD_PARAM, "rank");
    int n = (int)xDesc->nb_dims;
    derivedBnDesc->dims[0] = 1;
    for (int i = 1; i < n; i++)
        derivedBnDesc->dims[i] = (i == 1 || mode == 0) ? xDesc->dims[i] : 1;
    derivedBnDesc->strides[n - 1] = 1;
    for (int i = n - 2; i >= 0; i--)
        derivedBnDesc->strides[i] = derivedBnDesc->strides[i + 1] * derivedBnDesc->dims[i + 1];
    derivedBnDesc->dtype = (xDesc->dtype == 2 || xDesc->dtype == 9) ? 0 : xDesc->dtype;
    derivedBnDesc->nb_dims = n;
    derivedBnDesc->set = 1;
    derivedBnDesc->derived_from = U(xDesc);
    derivedBnDesc->derive_mode = mode;
    return 0;
}

cudnnStatus_t cudnnBatchNormalizationForwardInference(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, const void *alpha, const void *beta,
        const cudnnTensorDescriptor_t xDesc, const void *x, const cudnnTensorDescriptor_t yDesc,
        void *y, const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
        const void *bnBias, const void *estimatedMean, const void *estimatedVariance,
        double epsilon) {
    cudnnStatus_t status = launch(handle);
    if (status) return status;
    CHECK(alpha && beta && x && y && bnScale && bnBias && estimatedMean && estimatedVariance,
          BAD_PARAM, "non-null");
    CHECK(rank_4_or_5(xDesc) && valid_mode(mode, 0), BAD_PARAM, "rank");
    CHECK(alike(xDesc, yDesc), BAD_PARAM, "same-dims");
    CHECK(one_and_zero(alpha, beta, xDesc), BAD_PARAM, "alpha-beta");
    CHECK(bn_of(bnScaleBiasMeanVarDesc, xDesc, mode), BAD_PARAM, "bn-desc");
    CHECK(epsilon >= 0, BAD_PARAM, "epsilon");
    int64_t data = element_size(xDesc->dtype), stat = element_size(bnScaleBiasMeanVarDesc->dtype);
    CHECK(aligned(x, data) && aligned(y, data) && aligned(bnScale, stat) && aligned(bnBias, stat)
          && aligned(estimatedMean, stat) && aligned(estimatedVariance, stat),
          MISALIGNED_POINTER, "aligned");
    ForwardInferenceCall *c = &stub_forward_inference;
    c->calls++;
    c->handle = U(handle); c->mode = mode;
    c->alpha = scaling(alpha, xDesc); c->beta = scaling(beta, xDesc);
    c->x_desc = U(xDesc); c->x = U(x); c->y_desc = U(yDesc); c->y = U(y);
    c->bn_desc = U(bnScaleBiasMeanVarDesc); c->scale = U(bnScale); c->bias = U(bnBias);
    c->estimated_mean = U(estimatedMean); c->estimated_variance = U(estimatedVariance);
    c->epsilon = epsilon;
    return answer(c->status);
}

cudnnStatus_t cudnnBatchNormalizationForwardTraining(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, const void *alpha, const void *beta,
        const cudnnTensorDescriptor_t xDesc, const void *x, const cudnnTensorDescriptor_t yDesc,
        void *y, const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
        const void *bnBias, double exponentialAverageFactor, void *resultRunningMean,
        void *resultRunningVariance, double epsilon, void *resultSaveMean,
        void *resultSaveInvVariance) {
    return handle == NULL ? fail(NULL_POINTER) : 0;
}

cudnnStatus_t cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const cudnnTensorDescriptor_t xDesc,
        const cudnnTensorDescriptor_t zDesc, const cudnnTensorDescriptor_t yDesc,
        const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc,
        const cudnnActivationDescriptor_t activationDesc, size_t *sizeInBytes) {
    if (sizeInBytes == NULL) return fail(NULL_POINTER);
    cudnnStatus_t status = use_handle(handle);
    if (status) return status;
    CHECK(rank_4_or_5(xDesc) && valid_mode(mode, bnOps), BAD_PARAM, "rank");
    ForwardWorkspaceQuery *q = &stub_forward_query;
    q->calls++;
    q->handle = U(handle); q->mode = mode; q->bn_ops = bnOps;
    q->x_desc = U(xDesc); q->z_desc = U(zDesc); q->y_desc = U(yDesc);
    q->bn_desc = U(bnScaleBiasMeanVarDesc); q->activation_desc = U(activationDesc);
    *sizeInBytes = stub_workspace_bytes;
    xDesc->forward_workspace[mode][bnOps] = (int64_t)stub_workspace_bytes;
    return 0;
}

cudnnStatus_t cudnnGetBatchNormalizationBackwardExWorkspaceSize(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const cudnnTensorDescriptor_t xDesc,
        const cudnnTensorDescriptor_t yDesc, const cudnnTensorDescriptor_t dyDesc,
        const cudnnTensorDescriptor_t dzDesc, const cudnnTensorDescriptor_t dxDesc,
        const cudnnTensorDescriptor_t dBnScaleBiasDesc,
        const cudnnActivationDescriptor_t activationDesc, size_t *sizeInBytes) {
    if (sizeInBytes == NULL) return fail(NULL_POINTER);
    cudnnStatus_t status = use_handle(handle);
    if (status) return status;
    CHECK(rank_4_or_5(xDesc) && valid_mode(mode, bnOps), BAD_PARAM, "rank");
    BackwardWorkspaceQuery *q = &stub_backward_query;
    q->calls++;
    q->handle = U(handle); q->mode = mode; q->bn_ops = bnOps;
    q->x_desc = U(xDesc); q->y_desc = U(yDesc); q->dy_desc = U(dyDesc); q->dz_desc = U(dzDesc);
    q->dx_desc = U(dxDesc); q->bn_desc = U(dBnScaleBiasDesc);
    q->activation_desc = U(activationDesc);
    *sizeInBytes = stub_workspace_bytes;
    xDesc->backward_workspace[mode][bnOps] = (int64_t)stub_workspace_bytes;
    return 0;
}

cudnnStatus_t cudnnGetBatchNormalizationTrainingExReserveSpaceSize(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps,
        const cudnnActivationDescriptor_t activationDesc, const cudnnTensorDescriptor_t xDesc,
        size_t *sizeInBytes) {
    if (sizeInBytes == NULL) return fail(NULL_POINTER);
    cudnnStatus_t status = use_handle(handle);
    if (status) return status;
    CHECK(rank_4_or_5(xDesc) && valid_mode(mode, bnOps), BAD_PARAM, "rank");
    ReserveQuery *q = &stub_reserve_query;
    q->calls++;
    q->handle = U(handle); q->mode = mode; q->bn_ops = bnOps;
    q->activation_desc = U(activationDesc); q->x_desc = U(xDesc);
    *sizeInBytes = stub_reserve_bytes;
    xDesc->reserve[mode][bnOps] = (int64_t)stub_reserve_bytes;
    return 0;
}

cudnnStatus_t cudnnBatchNormalizationForwardTrainingEx(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const void *alpha,
        const void *beta, const cudnnTensorDescriptor_t xDesc, const void *xData,
        const cudnnTensorDescriptor_t zDesc, const void *zData,
        const cudnnTensorDescriptor_t yDesc, void *yData,
        const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
        const void *bnBias, double exponentialAverageFactor, void *resultRunningMean,
        void *resultRunningVariance, double epsilon, void *resultSaveMean,
        void *resultSaveInvVariance, cudnnActivationDescriptor_t activationDesc,
        void *workspace, size_t workSpaceSizeInBytes, void *reserveSpace,
        size_t reserveSpaceSizeInBytes) {
    cudnnStatus_t status = launch(handle);
    if (status) return status;
    CHECK(alpha && beta && xData && yData && bnScale && bnBias, BAD_PARAM, "non-null");
    CHECK(both_or_neither(resultSaveMean, resultSaveInvVariance), BAD_PARAM, "saved-pair");
    CHECK(both_or_neither(resultRunningMean, resultRunningVariance), BAD_PARAM, "running-pair");
    CHECK(rank_4_or_5(xDesc) && valid_mode(mode, bnOps), BAD_PARAM, "rank");
    CHECK(alike(xDesc, yDesc), BAD_PARAM, "same-dims");
    CHECK(one_and_zero(alpha, beta, xDesc), BAD_PARAM, "alpha-beta");
    CHECK(bnOps != OPS_ADD || (zData != NULL && alike(xDesc, zDesc)), BAD_PARAM, "add-operand");
    CHECK(bn_of(bnScaleBiasMeanVarDesc, xDesc, mode), BAD_PARAM, "bn-desc");
    CHECK(epsilon >= 0, BAD_PARAM, "epsilon");
    status = fused_ok(mode, bnOps, xDesc, activationDesc);
    if (status) return status;
    CHECK(bnOps == OPS_BN || (nhwc_packed(yDesc) && (bnOps != OPS_ADD || nhwc_packed(zDesc))),
          NOT_SUPPORTED_LAYOUT, "fused-layout");
    int fast = mode == PERSISTENT || bnOps != OPS_BN;
    status = workspace_ok(workspace, workSpaceSizeInBytes,
                          xDesc->forward_workspace[mode][bnOps], fast);
    if (status) return status;
    status = reserve_ok(reserveSpace, reserveSpaceSizeInBytes, xDesc->reserve[mode][bnOps],
                        fast, 0, mode, bnOps, xDesc);
    if (status) return status;
    int64_t data = element_size(xDesc->dtype), stat = element_size(bnScaleBiasMeanVarDesc->dtype);
    CHECK(aligned(xData, data) && aligned(yData, data) && aligned(zData, data)
          && aligned(bnScale, stat) && aligned(bnBias, stat) && aligned(resultRunningMean, stat)
          && aligned(resultRunningVariance, stat) && aligned(resultSaveMean, stat)
          && aligned(resultSaveInvVariance, stat), MISALIGNED_POINTER, "aligned");
    if (reserveSpace != NULL) stub_fill_reserve(U(reserveSpace), xDesc, mode, bnOps);
    ForwardTrainingCall *c = &stub_forward_training;
    c->calls++;
    c->handle = U(handle); c->mode = mode; c->bn_ops = bnOps;
    c->alpha = scaling(alpha, xDesc); c->beta = scaling(beta, xDesc);
    c->x_desc = U(xDesc); c->x = U(xData); c->z_desc = U(zDesc); c->z = U(zData);
    c->y_desc = U(yDesc); c->y = U(yData);
    c->bn_desc = U(bnScaleBiasMeanVarDesc); c->scale = U(bnScale); c->bias = U(bnBias);
    c->exponential_average_factor = exponentialAverageFactor;
    c->running_mean = U(resultRunningMean); c->running_var = U(resultRunningVariance);
    c->epsilon = epsilon;
    c->save_mean = U(resultSaveMean); c->save_inv_variance = U(resultSaveInvVariance);
    c->activation_desc = U(activationDesc);
    c->workspace = U(workspace); c->workspace_size = workSpaceSizeInBytes;
    c->reserve = U(reserveSpace); c->reserve_size = reserveSpaceSizeInBytes;
    return answer(c->status);
}

cudnnStatus_t cudnnBatchNormalizationBackward(cudnnHandle_t handle, cudnnBatchNormMode_t mode,
        const void *alphaDataDiff, const void *betaDataDiff, const void *alphaParamDiff,
        const void *betaParamDiff, const cudnnTensorDescriptor_t xDesc, const void *x,
        const cudnnTensorDescriptor_t dyDesc, const void *dy,
        const cudnnTensorDescriptor_t dxDesc, void *dx,
        const cudnnTensorDescriptor_t dBnScaleBiasDesc, const void *bnScale,
        void *dBnScaleResult, void *dBnBiasResult, double epsilon, const void *savedMean,
        const void *savedInvVariance) {
    return handle == NULL ? fail(NULL_POINTER) : 0;
}

cudnnStatus_t cudnnBatchNormalizationBackwardEx(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const void *alphaDataDiff,
        const void *betaDataDiff, const void *alphaParamDiff, const void *betaParamDiff,
        const cudnnTensorDescriptor_t xDesc, const void *xData,
        const cudnnTensorDescriptor_t yDesc, const void *yData,
        const cudnnTensorDescriptor_t dyDesc, const void *dyData,
        const cudnnTensorDescriptor_t dzDesc, void *dzData,
        const cudnnTensorDescriptor_t dxDesc, void *dxData,
        const cudnnTensorDescriptor_t dBnScaleBiasDesc, const void *bnScaleData,
        const void *bnBiasData, void *dBnScaleData, void *dBnBiasData, double epsilon,
        const void *savedMean, const void *savedInvVariance,
        cudnnActivationDescriptor_t activationDesc, void *workSpace,
        size_t workSpaceSizeInBytes, void *reserveSpace, size_t reserveSpaceSizeInBytes) {
    cudnnStatus_t status = launch(handle);
    if (status) return status;
    CHECK(alphaDataDiff && betaDataDiff && alphaParamDiff && betaParamDiff && xData && dyData
          && dxData && bnScaleData && dBnScaleData && dBnBiasData, BAD_PARAM, "non-null");
    CHECK(both_or_neither(savedMean, savedInvVariance), BAD_PARAM, "saved-pair");
    CHECK(mode != PERSISTENT || savedMean != NULL, BAD_PARAM, "persistent-saved");
    CHECK(rank_4_or_5(xDesc) && valid_mode(mode, bnOps), BAD_PARAM, "rank");
    CHECK(alike(xDesc, dyDesc) && alike(xDesc, dxDesc), BAD_PARAM, "same-dims");
    CHECK(one_and_zero(alphaDataDiff, betaDataDiff, xDesc)
          && one_and_zero(alphaParamDiff, betaParamDiff, xDesc), BAD_PARAM, "alpha-beta");
    CHECK(bnOps == OPS_BN || (yData != NULL && bnBiasData != NULL && alike(xDesc, yDesc)),
          BAD_PARAM, "fused-operands");
    CHECK(bnOps != OPS_ADD || (dzData != NULL && alike(xDesc, dzDesc)), BAD_PARAM,
          "add-operand");
    CHECK(bn_of(dBnScaleBiasDesc, xDesc, mode), BAD_PARAM, "bn-desc");
    CHECK(epsilon >= 0, BAD_PARAM, "epsilon");
    status = fused_ok(mode, bnOps, xDesc, activationDesc);
    if (status) return status;
    CHECK(bnOps == OPS_BN || (nhwc_packed(yDesc) && nhwc_packed(dyDesc) && nhwc_packed(dxDesc)
          && (bnOps != OPS_ADD || nhwc_packed(dzDesc))), NOT_SUPPORTED_LAYOUT, "fused-layout");
    int fast = mode == PERSISTENT || bnOps != OPS_BN;
    status = workspace_ok(workSpace, workSpaceSizeInBytes,
                          xDesc->backward_workspace[mode][bnOps], fast);
    if (status) return status;
    status = reserve_ok(reserveSpace, reserveSpaceSizeInBytes, xDesc->reserve[mode][bnOps],
                        fast, 1, mode, bnOps, xDesc);
    if (status) return status;
    int64_t data = element_size(xDesc->dtype), stat = element_size(dBnScaleBiasDesc->dtype);
    CHECK(aligned(xData, data) && aligned(yData, data) && aligned(dyData, data)
          && aligned(dzData, data) && aligned(dxData, data) && aligned(bnScaleData, stat)
          && aligned(bnBiasData, stat) && aligned(dBnScaleData, stat)
          && aligned(dBnBiasData, stat) && aligned(savedMean, stat)
          && aligned(savedInvVariance, stat), MISALIGNED_POINTER, "aligned");
    BackwardCall *c = &stub_backward;
    c->calls++;
    c->handle = U(handle); c->mode = mode; c->bn_ops = bnOps;
    c->alpha_data = scaling(alphaDataDiff, xDesc);
    c->beta_data = scaling(betaDataDiff, xDesc);
    c->alpha_param = scaling(alphaParamDiff, xDesc);
    c->beta_param = scaling(betaParamDiff, xDesc);
    c->x_desc = U(xDesc); c->x = U(xData); c->y_desc = U(yDesc); c->y = U(yData);
    c->dy_desc = U(dyDesc); c->dy = U(dyData); c->dz_desc = U(dzDesc); c->dz = U(dzData);
    c->dx_desc = U(dxDesc); c->dx = U(dxData);
    c->bn_desc = U(dBnScaleBiasDesc); c->scale = U(bnScaleData); c->bias = U(bnBiasData);
    c->dscale = U(dBnScaleData); c->dbias = U(dBnBiasData);
    c->epsilon = epsilon;
    c->saved_mean = U(savedMean); c->saved_inv_variance = U(savedInvVariance);
    c->activation_desc = U(activationDesc);
    c->workspace = U(workSpace); c->workspace_size = workSpaceSizeInBytes;
    c->reserve = U(reserveSpace); c->reserve_size = reserveSpaceSizeInBytes;
    return answer(c->status);
}
"""

STUB_SOURCE = (
    STUB_PRELUDE
    + STUB_DECLARATIONS
    + "".join(_c_struct(record) for record in RECORDS.values())
    + STUB_DEFINITIONS
)


class Stub:
    """The loaded stub, read and written through ctypes: a record per entry of ``RECORDS``,
    what the size queries answer (``workspace_bytes``, ``reserve_bytes``) and the descriptors
    created and not yet destroyed (``live_tensors``, ``live_activations``)."""

    set_stream: StreamCall
    runtime_error: RuntimeErrorQuery
    backward_query: BackwardWorkspaceQuery
    forward_query: ForwardWorkspaceQuery
    reserve_query: ReserveQuery
    backward: BackwardCall
    forward_training: ForwardTrainingCall
    forward_inference: ForwardInferenceCall

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.cdll = cdll
        for name, record in RECORDS.items():
            setattr(self, name, record.in_dll(cdll, f"stub_{name}"))
        self.workspace_bytes = c_uint64.in_dll(cdll, "stub_workspace_bytes")
        self.reserve_bytes = c_uint64.in_dll(cdll, "stub_reserve_bytes")
        self.live_tensors = c_int64.in_dll(cdll, "stub_live_tensors")
        self.live_activations = c_int64.in_dll(cdll, "stub_live_activations")
        self.device = c_int64.in_dll(cdll, "stub_device")
        cdll.stub_fill_reserve.argtypes = [c_uint64, c_void_p, c_int64, c_int64]

    def reset(self) -> None:
        for name in RECORDS:
            record = getattr(self, name)
            ctypes.memset(ctypes.addressof(record), 0, ctypes.sizeof(record))
        self.workspace_bytes.value, self.reserve_bytes.value = STUB_WORKSPACE, STUB_RESERVE
        self.device.value = 0
        self.cdll.stub_forget_reserves()

    def fill_reserve(self, reserve: int, kernel: Any) -> None:
        """Stand in for the forward that filled ``reserve`` for a backward ``kernel`` (a
        cuDNN engine): same mode, bnOps and x, as cuDNN wants of a backward's reserve."""
        status = self.cdll.stub_fill_reserve(reserve, kernel.x_desc, kernel.bn_mode, kernel.ops)
        assert status == 0, "the stub's reserve table is full"

    def calls(self) -> dict[str, int]:
        """How many times each recorded function ran since ``reset``."""
        return {name: getattr(self, name).calls for name in RECORDS}

    @staticmethod
    def tensor(address: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(cudnnDataType_t, dims, strides) of the live stub descriptor at ``address``."""
        assert address, "a NULL tensor descriptor"
        t = TensorRecord.from_address(address)
        assert t.set != -1, "a tensor descriptor read after it was destroyed"
        assert t.set == 1, "a tensor descriptor that was never set"
        return t.dtype, tuple(t.dims[: t.nb_dims]), tuple(t.strides[: t.nb_dims])

    @staticmethod
    def activation(address: int) -> tuple[int, int, float]:
        """(mode, NaN propagation, coef) of the live stub activation descriptor at ``address``."""
        assert address, "a NULL activation descriptor"
        a = ActivationRecord.from_address(address)
        assert a.set != -1, "an activation descriptor read after it was destroyed"
        assert a.set == 1, "an activation descriptor that was never set"
        return a.mode, a.nan_opt, a.coef


def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub, compiled once per test session (skips the test where there is no gcc)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the stub libcudnn these tests run on cannot be built")
    return _compile(tmp_path_factory.getbasetemp())


@functools.cache
def _compile(base: Path) -> Path:
    folder = base / "stub_cudnn"
    folder.mkdir(exist_ok=True)
    source, library = folder / "stub_cudnn.c", folder / "libstub_cudnn.so"
    source.write_text(STUB_SOURCE)
    command = ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", library, source]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return library


def _no_cupy(*args: object) -> None:
    raise AssertionError("the cuDNN fast path entered a CuPy stream scope")


def install(path: Path, monkeypatch: pytest.MonkeyPatch) -> Stub:
    """The stub as this process's libcudnn, with fresh handle and thread state and no CUDA."""
    cdll = ctypes.CDLL(str(path))
    info = CudnnInfo(path=str(path), found_via="test stub", version=STUB_VERSION)
    monkeypatch.setattr(library_module, "_library", CudnnLibrary(cdll, info))
    monkeypatch.setattr(handle_module, "_free", {})
    monkeypatch.setattr(runtime_module, "_current", threading.local())
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "stream_scope", _no_cupy)
    stub = Stub(cdll)
    stub.reset()
    return stub


# --- fake device pointers and layouts ------------------------------------------------------

# Every operand of every operator, by name; distinct, above 2^32 (a truncated pointer would
# show), never dereferenced.
OPERANDS = (
    "grad_input", "grad_weight", "grad_bias", "input", "grad_output", "weight",
    "running_mean", "running_var", "output", "bias", "grad_z", "z", "saved_mean",
    "saved_invstd", "reserve",
)  # fmt: skip
POINTERS = {name: 0x7F00_0000_0000 + (index + 1) * 0x10_0000 for index, name in enumerate(OPERANDS)}
WORKSPACE = 0x7E00_0000_0000
STREAM = 0x5EA_0000_0000


def capi_tensor(desc: TensorDesc | None) -> c_void_p:
    """An ``infiniopTensorDescriptor_t`` made through the C API for ``desc`` (NULL for None)."""
    if desc is None:
        return c_void_p()
    out, n = c_void_p(), desc.ndim
    shape, strides = (c_size_t * n)(*desc.shape), (c_ssize_t * n)(*desc.strides)
    status = capi.infiniopCreateTensorDescriptor(ctypes.byref(out), n, shape, strides, desc.dtype)
    assert status == Status.SUCCESS, capi.last_error()
    return out


def pointers(names: str) -> tuple[int, ...]:
    return tuple(POINTERS[name] for name in names.split())


def fields(record: ctypes.Structure, names: str) -> tuple:
    return tuple(getattr(record, name) for name in names.split())


def layout_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Packed strides of ``shape`` in ``layout`` ("contiguous" or "channels_last")."""
    return channels_last(shape) if layout == "channels_last" else contiguous_strides(shape)


def padded(shape: tuple[int, ...]) -> tuple[int, ...]:
    """As cuDNN is given it: ranks below 4 padded with size-1 axes (as PyTorch does)."""
    return tuple(shape) + (1,) * (4 - len(shape))


def cudnn_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The packed strides of ``padded(shape)`` in ``layout``: what cuDNN must be told, size-1
    axes included (PyTorch's fixSizeOneDimStride): (N, C, L) channels-last is (N, C, L, 1)
    with strides (C*L, 1, C, C)."""
    return layout_strides(padded(shape), layout)


def expected_bn_mode(shape: tuple[int, ...], layout: str, training: bool = True) -> int:
    """PyTorch's choice for the 3-D to 5-D input cuDNN gets: SPATIAL_PERSISTENT for
    channels-last (4-D, 5-D) training, else SPATIAL (NLC included)."""
    if training and layout == "channels_last" and len(shape) >= 4:
        return SPATIAL_PERSISTENT
    return SPATIAL


def bn_dtype(dtype: DataType) -> int:
    """The dtype of the per-channel descriptor cuDNN derives for ``dtype`` data."""
    return CUDNN_DOUBLE if dtype == F64 else CUDNN_FLOAT


def assert_derived_bn_desc(bn_desc: int, x_desc: int, mode: int, shape, dtype) -> None:
    """``bn_desc`` is the descriptor cuDNN derived from ``x_desc`` for ``mode``."""
    bn = TensorRecord.from_address(bn_desc)
    assert (bn.derived_from, bn.derive_mode) == (x_desc, mode)
    rest = padded(shape)[2:] if mode == PER_ACTIVATION else (1,) * (len(padded(shape)) - 2)
    assert Stub.tensor(bn_desc)[:2] == (bn_dtype(dtype), (1, shape[1], *rest))


def in_workspace(address: int, nbytes: int, workspace_size: int) -> bool:
    """Whether ``nbytes`` at ``address`` lie in the workspace after cuDNN's own scratch."""
    start, end = WORKSPACE + STUB_WORKSPACE, WORKSPACE + workspace_size
    return start <= address and address + nbytes <= end


# --- problem tables shared by the backward and forward tests --------------------------------

# (input dtype, per-channel dtype) that need no staging: cuDNN's own statistics dtype.
FAST_DTYPES = [(F16, F32), (F32, F32), (F64, F64)]


def fast_cases():
    """(shape, dtype, channel dtype, layout) of every cuDNN fast-path problem (3-D to 5-D:
    2-D input goes to the CuPy engine, as PyTorch sends none to cuDNN)."""
    for shape in (s for s in SHAPES if len(s) > 2):
        for dtype, channel_dtype in FAST_DTYPES:
            for layout in ("contiguous", "channels_last"):
                yield pytest.param(
                    shape, dtype, channel_dtype, layout, id=f"{shape}-{dtype.name}-{layout}"
                )


# The ``persistent`` attribute of training (forward and backward): None lets the backend
# choose (PERSISTENT for channels-last 4-D/5-D), True asks for it, False forbids it.
PERSISTENT_CASES = {  # (shape, layout, persistent, mode)
    "NHWC auto": ((2, 3, 4, 5), "channels_last", None, SPATIAL_PERSISTENT),
    "NHWC forbidden": ((2, 3, 4, 5), "channels_last", False, SPATIAL),
    "NDHWC forbidden": ((2, 3, 2, 3, 4), "channels_last", False, SPATIAL),
    "NCHW auto": ((2, 3, 4, 5), "contiguous", None, SPATIAL),
    "NCHW asked": ((2, 3, 4, 5), "contiguous", True, SPATIAL_PERSISTENT),
    "NLC asked": ((2, 3, 5), "channels_last", True, SPATIAL_PERSISTENT),
}

# Shapes cuDNN's fused kernels take as F16 channels-last data: C % 4 == 0, 4-D.
FUSED_SHAPES = [(2, 8, 3, 5)]
FUSIONS = {"relu": OPS_BN_ACTIVATION, "add_relu": OPS_BN_ADD_ACTIVATION}
# Which engine serves a fused pass: cuDNN only in SPATIAL_PERSISTENT mode on F16 NHWC data
# (BN+Add+ReLU also with C % 4 == 0; a backward also from saved statistics), the CuPy engine
# for the rest.
FUSED_ENGINES = {  # (engine, shape, dtype, channel dtype, layout, persistent)
    "F16 NHWC": ("cudnn", (2, 8, 3, 5), F16, F32, "channels_last", None),
    "F16 NHWC persistent": ("cudnn", (2, 8, 3, 5), F16, F32, "channels_last", True),
    "F16 NDHWC": ("cupy", (2, 4, 2, 3, 2), F16, F32, "channels_last", None),
    "F16 NHWC not persistent": ("cupy", (2, 8, 3, 5), F16, F32, "channels_last", False),
    "F32 NHWC": ("cupy", (2, 8, 3, 5), F32, F32, "channels_last", None),
    "F64 NHWC": ("cupy", (2, 8, 3, 5), F64, F64, "channels_last", None),
    "BF16 NHWC": ("cupy", (2, 8, 3, 5), BF16, F32, "channels_last", None),
    "F16 NCHW": ("cupy", (2, 8, 3, 5), F16, F32, "contiguous", None),
    "F16 NCHW persistent": ("cupy", (2, 8, 3, 5), F16, F32, "contiguous", True),
    # cuDNN >= 8.2 wants C % 4 == 0 for BN+Add+ReLU only.
    "F16 NHWC C=6": (
        {"relu": "cudnn", "add_relu": "cupy"},
        (2, 6, 3, 5),
        F16,
        F32,
        "channels_last",
        None,
    ),
    "F16 NLC": ("cupy", (2, 8, 5), F16, F32, "channels_last", None),
    "F16 NC": ("cupy", (6, 8), F16, F32, "contiguous", True),
}


def fused_engine(engine: str | dict[str, str], fusion: str) -> str:
    """The engine of a ``FUSED_ENGINES`` case for ``fusion`` (a case may depend on it)."""
    return engine[fusion] if isinstance(engine, dict) else engine


def forward_filled(desc: Any, reserve: int) -> None:
    """Stand in for the forward that filled ``reserve`` for the backward descriptor ``desc``
    (on the cuDNN engine): the stub takes a backward's reserve only from a matching forward."""
    Stub(library_module._library._cdll).fill_reserve(reserve, desc._kernel)


def nothing_recorded(stub: Stub) -> bool:
    """Whether no recorded cuDNN function ran since ``reset``."""
    return not any(stub.calls().values())


def only(*names: str) -> dict[str, int]:
    """What ``Stub.calls()`` is when exactly the recorded functions ``names`` ran, once each."""
    return {name: int(name in names) for name in RECORDS}
