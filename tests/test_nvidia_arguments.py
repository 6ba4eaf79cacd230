"""The exact arguments the NVIDIA backend hands cuDNN, checked without a GPU.

A stub libcudnn, compiled here from C, stands in for the real one: it exports every function
of the prototype table with cuDNN's C signatures, answers SUCCESS, keeps tensor descriptors
well enough to be set, derived and read back, reports fixed workspace and reserve sizes, and
records the arguments of the last ``cudnnSetStream``, workspace query and
``cudnnBatchNormalizationBackwardEx``. The tests install it as the process's libcudnn, stand
in for the CUDA seam (``cudnn_bn.backends.cuda``: device 0 current, one device), build
descriptors through the operator layer and the C API, compute on fake device pointers, and
read back what cuDNN would have been given. On the cuDNN fast path (per-channel tensors
already in cuDNN's dtype with stride 1) nothing touches CuPy, so ``stream_scope`` fails the
test if it is entered.
"""

import ctypes
import gc
import shutil
import subprocess
import threading
from ctypes import c_double, c_int, c_int64, c_size_t, c_ssize_t, c_uint64, c_void_p
from pathlib import Path

import pytest
from c_headers import cudnn_functions, parse_functions

import cudnn_bn
from cudnn_bn import BatchNormBackwardDescriptor, DataType, Device, Mode, Status, TensorDesc, capi
from cudnn_bn import runtime as runtime_module
from cudnn_bn._cudnn import handle as handle_module
from cudnn_bn._cudnn import library as library_module
from cudnn_bn._cudnn.library import CudnnLibrary
from cudnn_bn._cudnn.loader import CudnnInfo
from cudnn_bn._cudnn.prototypes import PROTOTYPES
from cudnn_bn.backends import cuda
from cudnn_bn.errors import (
    BadParamError,
    BadTensorDtypeError,
    BadTensorShapeError,
    InfiniError,
    InsufficientWorkspaceError,
    NullPointerError,
)
from cudnn_bn.tensor import contiguous_strides

F16, BF16, F32, F64 = DataType.F16, DataType.BF16, DataType.F32, DataType.F64
# cudnnDataType_t and cudnnBatchNormMode_t values, written out as cuDNN's headers have them.
CUDNN_FLOAT, CUDNN_DOUBLE, CUDNN_HALF = 0, 1, 2
CUDNN_TYPE = {F16: CUDNN_HALF, F32: CUDNN_FLOAT, F64: CUDNN_DOUBLE}
PER_ACTIVATION, SPATIAL, OPS_BN = 0, 1, 0

STUB_VERSION = 92800
STUB_WORKSPACE = 4096
STUB_RESERVE = 512

# --- the stub library ----------------------------------------------------------------------

# Every record field is 8 bytes wide, so the C struct and its ctypes mirror cannot disagree
# on padding; the C structs are generated from the ctypes ones below.
DOUBLE_FIELDS = {"alpha_data", "beta_data", "alpha_param", "beta_param", "epsilon"}


def _fields(names: str) -> list[tuple[str, type]]:
    return [(name, c_double if name in DOUBLE_FIELDS else c_uint64) for name in names.split()]


class StreamCall(ctypes.Structure):
    _fields_ = _fields("calls handle stream")


class WorkspaceQuery(ctypes.Structure):
    _fields_ = _fields(
        "calls handle mode bn_ops x_desc y_desc dy_desc dz_desc dx_desc bn_desc activation_desc"
    )


class BackwardCall(ctypes.Structure):
    """``cudnnBatchNormalizationBackwardEx``'s arguments in order; alpha/beta are the values
    behind the pointers, read as double for DOUBLE data and as float otherwise."""

    _fields_ = _fields(
        "calls handle mode bn_ops alpha_data beta_data alpha_param beta_param"
        " x_desc x y_desc y dy_desc dy dz_desc dz dx_desc dx"
        " bn_desc scale bias dscale dbias epsilon saved_mean saved_inv_variance"
        " activation_desc workspace workspace_size reserve reserve_size"
    )


class TensorRecord(ctypes.Structure):
    """The stub's ``struct cudnnTensorStruct``, all 8-byte fields."""

    _fields_ = [  # set: 0 never set, 1 set, -1 destroyed
        ("set", c_int64), ("dtype", c_int64), ("nb_dims", c_int64), ("derive_mode", c_int64),
        ("derived_from", c_uint64), ("dims", c_int64 * 8), ("strides", c_int64 * 8),
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

typedef int cudnnStatus_t;
typedef int cudnnDataType_t;
typedef int cudnnBatchNormMode_t;
typedef int cudnnBatchNormOps_t;
typedef int cudnnActivationMode_t;
typedef int cudnnNanPropagation_t;
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
#define U(p) ((uint64_t)(uintptr_t)(p))

struct cudnnContext { cudaStream_t stream; };
struct cudnnTensorStruct {
    int64_t set, dtype, nb_dims, derive_mode;
    uint64_t derived_from;
    int64_t dims[MAX_DIMS], strides[MAX_DIMS];
};
struct cudnnActivationStruct { int mode; };

StreamCall stub_set_stream;
WorkspaceQuery stub_workspace_query;
BackwardCall stub_backward;
int stub_backward_status;          /* what cudnnBatchNormalizationBackwardEx returns */
uint64_t stub_workspace_bytes = 4096;
uint64_t stub_reserve_bytes = 512;
int64_t stub_live_tensors;         /* created minus destroyed tensor descriptors */
static int last_status;

static cudnnStatus_t fail(cudnnStatus_t status) { last_status = status; return status; }

/* An alpha/beta scaling factor: double for DOUBLE data, float otherwise, as cuDNN reads it. */
static double scaling(const void *p, cudnnTensorDescriptor_t x) {
    if (p == NULL) return -1e300;
    return x != NULL && x->dtype == 1 ? *(const double *)p : (double)*(const float *)p;
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
    if (last_status != 0) snprintf(message, max_size, "stub detail for %d", last_status);
    else message[0] = 0;
}

cudnnStatus_t cudnnCreate(cudnnHandle_t *handle) {
    if (handle == NULL) return fail(NULL_POINTER);
    *handle = calloc(1, sizeof **handle);
    return 0;
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
    if (handle == NULL) return fail(NULL_POINTER);
    free(handle);
    return 0;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId) {
    if (handle == NULL) return fail(NULL_POINTER);
    stub_set_stream.calls++;
    stub_set_stream.handle = U(handle);
    stub_set_stream.stream = U(streamId);
    handle->stream = streamId;
    return 0;
}

cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t *streamId) {
    if (handle == NULL || streamId == NULL) return fail(NULL_POINTER);
    *streamId = handle->stream;
    return 0;
}

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *tensorDesc) {
    if (tensorDesc == NULL) return fail(NULL_POINTER);
    *tensorDesc = calloc(1, sizeof **tensorDesc);
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
    if (nbDims < 1 || nbDims > MAX_DIMS) return fail(BAD_PARAM);
    for (int i = 0; i < nbDims; i++)
        if (dimA[i] < 1 || strideA[i] < 0) return fail(BAD_PARAM);
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
    return 0;
}

cudnnStatus_t cudnnSetActivationDescriptor(cudnnActivationDescriptor_t activationDesc,
        cudnnActivationMode_t mode, cudnnNanPropagation_t reluNanOpt, double coef) {
    if (activationDesc == NULL) return fail(NULL_POINTER);
    activationDesc->mode = mode;
    return 0;
}

cudnnStatus_t cudnnDestroyActivationDescriptor(cudnnActivationDescriptor_t activationDesc) {
    free(activationDesc);
    return 0;
}

/* (1, C, 1, ...) for SPATIAL, (1, C, H, W, ...) for PER_ACTIVATION, packed; FLOAT
   statistics for HALF and BFLOAT16 data, the data type otherwise. */
cudnnStatus_t cudnnDeriveBNTensorDescriptor(cudnnTensorDescriptor_t derivedBnDesc,
        const cudnnTensorDescriptor_t xDesc, cudnnBatchNormMode_t mode) {
    if (derivedBnDesc == NULL || xDesc == NULL) return fail(NULL_POINTER);
    if (xDesc->set != 1 || xDesc->nb_dims < 4 || mode < 0 || mode > 2) return fail(BAD_PARAM);
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
    return handle == NULL ? fail(NULL_POINTER) : 0;
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
    if (handle == NULL || sizeInBytes == NULL) return fail(NULL_POINTER);
    *sizeInBytes = stub_workspace_bytes;
    return 0;
}

cudnnStatus_t cudnnGetBatchNormalizationBackwardExWorkspaceSize(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const cudnnTensorDescriptor_t xDesc,
        const cudnnTensorDescriptor_t yDesc, const cudnnTensorDescriptor_t dyDesc,
        const cudnnTensorDescriptor_t dzDesc, const cudnnTensorDescriptor_t dxDesc,
        const cudnnTensorDescriptor_t dBnScaleBiasDesc,
        const cudnnActivationDescriptor_t activationDesc, size_t *sizeInBytes) {
    if (handle == NULL || sizeInBytes == NULL) return fail(NULL_POINTER);
    WorkspaceQuery *q = &stub_workspace_query;
    q->calls++;
    q->handle = U(handle); q->mode = mode; q->bn_ops = bnOps;
    q->x_desc = U(xDesc); q->y_desc = U(yDesc); q->dy_desc = U(dyDesc); q->dz_desc = U(dzDesc);
    q->dx_desc = U(dxDesc); q->bn_desc = U(dBnScaleBiasDesc);
    q->activation_desc = U(activationDesc);
    *sizeInBytes = stub_workspace_bytes;
    return 0;
}

cudnnStatus_t cudnnGetBatchNormalizationTrainingExReserveSpaceSize(cudnnHandle_t handle,
        cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps,
        const cudnnActivationDescriptor_t activationDesc, const cudnnTensorDescriptor_t xDesc,
        size_t *sizeInBytes) {
    if (handle == NULL || sizeInBytes == NULL) return fail(NULL_POINTER);
    *sizeInBytes = stub_reserve_bytes;
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
    return handle == NULL ? fail(NULL_POINTER) : 0;
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
    if (handle == NULL) return fail(NULL_POINTER);
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
    return stub_backward_status ? fail(stub_backward_status) : 0;
}
"""

STUB_SOURCE = (
    STUB_PRELUDE
    + STUB_DECLARATIONS
    + "".join(_c_struct(r) for r in (StreamCall, WorkspaceQuery, BackwardCall))
    + STUB_DEFINITIONS
)


class Stub:
    """The loaded stub: its records and switches, read and written through ctypes."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.cdll = cdll
        self.set_stream = StreamCall.in_dll(cdll, "stub_set_stream")
        self.workspace_query = WorkspaceQuery.in_dll(cdll, "stub_workspace_query")
        self.backward = BackwardCall.in_dll(cdll, "stub_backward")
        self.backward_status = c_int.in_dll(cdll, "stub_backward_status")
        self.live_tensors = c_int64.in_dll(cdll, "stub_live_tensors")

    def reset(self) -> None:
        for record in (self.set_stream, self.workspace_query, self.backward):
            ctypes.memset(ctypes.addressof(record), 0, ctypes.sizeof(record))
        self.backward_status.value = 0

    @staticmethod
    def tensor(address: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(cudnnDataType_t, dims, strides) of the live stub descriptor at ``address``."""
        assert address, "a NULL tensor descriptor"
        t = TensorRecord.from_address(address)
        assert t.set != -1, "a tensor descriptor read after it was destroyed"
        assert t.set == 1, "a tensor descriptor that was never set"
        return t.dtype, tuple(t.dims[: t.nb_dims]), tuple(t.strides[: t.nb_dims])


@pytest.fixture(scope="module")
def stub_path(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the stub libcudnn these tests run on cannot be built")
    folder = tmp_path_factory.mktemp("stub_cudnn")
    source, library = folder / "stub_cudnn.c", folder / "libstub_cudnn.so"
    source.write_text(STUB_SOURCE)
    command = ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", library, source]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return library


def _no_cupy(*args: object) -> None:
    raise AssertionError("the cuDNN fast path entered a CuPy stream scope")


@pytest.fixture
def stub(stub_path, monkeypatch) -> Stub:
    """The stub as this process's libcudnn, with fresh per-thread state and no CUDA."""
    cdll = ctypes.CDLL(str(stub_path))
    info = CudnnInfo(path=str(stub_path), found_via="test stub", version=STUB_VERSION)
    monkeypatch.setattr(library_module, "_library", CudnnLibrary(cdll, info))
    monkeypatch.setattr(handle_module, "_per_thread", threading.local())
    monkeypatch.setattr(runtime_module, "_current", threading.local())
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "stream_scope", _no_cupy)
    stub = Stub(cdll)
    stub.reset()
    return stub


# --- problems on fake device pointers ------------------------------------------------------

# The data pointers of compute() and infiniopBatchNormBackward, in the spec's order.
ARGUMENTS = (
    "grad_input", "grad_weight", "grad_bias", "input", "grad_output", "weight",
    "running_mean", "running_var",
)  # fmt: skip
# Distinct, above 2^32 (a truncated pointer would show), never dereferenced.
POINTERS = {
    name: 0x7F00_0000_0000 + (index + 1) * 0x10_0000 for index, name in enumerate(ARGUMENTS)
}
WORKSPACE = 0x7E00_0000_0000
STREAM = 0x5EA_0000_0000


def channels_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    order = (0, *range(2, len(shape)), 1)
    packed = contiguous_strides(tuple(shape[i] for i in order))
    strides = [0] * len(shape)
    for axis, stride in zip(order, packed, strict=True):
        strides[axis] = stride
    return tuple(strides)


def tensors(shape, dtype=F32, channel_dtype=None, *, strides=None, dy_strides=None):
    """The eight descriptors in the spec's order: grad_input, grad_weight, grad_bias, input,
    grad_output, weight, running_mean, running_var."""
    strides = strides or contiguous_strides(shape)
    channel = TensorDesc.contiguous(channel_dtype or dtype, (shape[1],))
    x = TensorDesc(dtype, shape, strides)
    dy = TensorDesc(dtype, shape, dy_strides or strides)
    dx = TensorDesc(dtype, shape, strides)
    return [dx, channel, channel, x, dy, channel, channel, channel]


def descriptor(shape, dtype=F32, channel_dtype=None, *, eps=1e-5, mode="train", **layout):
    handle = cudnn_bn.Handle(Device.NVIDIA, 0)
    return BatchNormBackwardDescriptor(
        handle, *tensors(shape, dtype, channel_dtype, **layout), eps=eps, mode=mode
    )


def compute(desc, workspace_size=None, *, workspace=WORKSPACE, stream=STREAM, **pointers):
    ptrs = {**POINTERS, **pointers}
    size = desc.workspace_size if workspace_size is None else workspace_size
    desc.compute(workspace, size, *(ptrs[name] for name in ARGUMENTS), stream=stream)


def pointers(names: str) -> tuple[int, ...]:
    return tuple(POINTERS[name] for name in names.split())


def fields(record: ctypes.Structure, names: str) -> tuple:
    return tuple(getattr(record, name) for name in names.split())


def padded(shape: tuple[int, ...]) -> tuple[int, ...]:
    """As cuDNN is given it: ranks below 4 padded with size-1 axes (as PyTorch does)."""
    return tuple(shape) + (1,) * (4 - len(shape))


def cudnn_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The packed strides of ``padded(shape)`` in ``layout``: what cuDNN must be told, size-1
    axes included (PyTorch's fixSizeOneDimStride): (N, C, L) channels-last is (N, C, L, 1)
    with strides (C*L, 1, C, C)."""
    shape = padded(shape)
    return channels_last(shape) if layout == "channels_last" else contiguous_strides(shape)


# --- the stub itself -----------------------------------------------------------------------


def test_stub_declares_every_prototype_as_cudnn_does():
    declared = parse_functions(STUB_DECLARATIONS)
    headers = cudnn_functions()
    for name in PROTOTYPES:
        assert name in declared, f"the stub does not define {name}; add it"
        stub_types = (declared[name].returns, [p.type for p in declared[name].params])
        header_types = (headers[name].returns, [p.type for p in headers[name].params])
        assert stub_types == header_types, name


def test_stub_exports_every_prototype(stub):
    missing = [name for name in PROTOTYPES if not hasattr(stub.cdll, name)]
    assert not missing
    assert cudnn_bn.cudnn_info().version == STUB_VERSION


LAYOUTS = [((6, 3), (3, 1)), ((2, 3, 5), (15, 1, 3)), ((2, 3, 4, 5), (60, 1, 15, 3))]


@pytest.mark.parametrize(("shape", "strides"), LAYOUTS)
@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=lambda d: d.name)
def test_stub_descriptors_agree_with_real_cudnn(stub_path, monkeypatch, shape, strides, dtype):
    """Set, derive and read back give the same answers from the stub as from libcudnn."""
    from cudnn_bn._cudnn.enums import BatchNormMode
    from cudnn_bn._cudnn.tensor import TensorDescriptor

    try:
        real = library_module.cudnn()
    except InfiniError as exc:
        pytest.skip(f"no real libcudnn to compare with: {exc}")
    fake = CudnnLibrary(ctypes.CDLL(str(stub_path)), real.info)
    answers = []
    for lib in (real, fake):
        monkeypatch.setattr(library_module, "_library", lib)
        with TensorDescriptor.nd(CUDNN_TYPE[dtype], shape, strides) as x:
            derived = [TensorDescriptor.derive_bn(x, mode) for mode in BatchNormMode]
            answers.append([x.read()] + [d.read() for d in derived])
            for d in derived:
                d.close()
    assert answers[0] == answers[1]


# --- the cuDNN fast path: every argument ---------------------------------------------------

SHAPES = [(6, 3), (2, 3, 5), (2, 3, 4, 5), (2, 3, 2, 3, 4)]
# (input dtype, per-channel dtype) that need no staging: cuDNN's own statistics dtype.
FAST_DTYPES = [(F16, F32), (F32, F32), (F64, F64)]


def fast_cases():
    for shape in SHAPES:
        for dtype, channel_dtype in FAST_DTYPES:
            for layout in ("contiguous", "channels_last") if len(shape) > 2 else ("contiguous",):
                yield pytest.param(
                    shape, dtype, channel_dtype, layout, id=f"{shape}-{dtype.name}-{layout}"
                )


@pytest.mark.parametrize(("shape", "dtype", "channel_dtype", "layout"), list(fast_cases()))
def test_fast_path_arguments(stub, shape, dtype, channel_dtype, layout):
    strides = channels_last(shape) if layout == "channels_last" else contiguous_strides(shape)
    with descriptor(shape, dtype, channel_dtype, eps=1e-3, strides=strides) as desc:
        assert desc.engine == "cudnn"
        assert desc.workspace_size == STUB_WORKSPACE
        assert desc.reserve_size == STUB_RESERVE
        compute(desc)
        call, query = stub.backward, stub.workspace_query
        assert call.calls == 1

        # The handle, on the caller's stream.
        assert call.handle != 0
        assert (stub.set_stream.calls, stub.set_stream.handle) == (1, call.handle)
        assert stub.set_stream.stream == STREAM

        bn_mode = PER_ACTIVATION if len(shape) == 2 else SPATIAL
        assert (call.mode, call.bn_ops) == (bn_mode, OPS_BN)
        assert (call.alpha_data, call.beta_data, call.alpha_param, call.beta_param) == (1, 0, 1, 0)

        # x, dy and dx: the input's dims (padded to 4-D), packed strides and dtype.
        expected = (CUDNN_TYPE[dtype], padded(shape), cudnn_strides(shape, layout))
        for name in ("x_desc", "dy_desc", "dx_desc"):
            assert stub.tensor(getattr(call, name)) == expected, name
        # The per-channel descriptor is the one derived from x's for this mode.
        bn = TensorRecord.from_address(call.bn_desc)
        assert (bn.derived_from, bn.derive_mode) == (call.x_desc, bn_mode)
        channel_dims = (1, shape[1]) + (1,) * (max(len(shape), 4) - 2)
        bn_type = CUDNN_DOUBLE if dtype == F64 else CUDNN_FLOAT
        assert stub.tensor(call.bn_desc)[:2] == (bn_type, channel_dims)

        # No fused add or activation.
        assert (call.y_desc, call.y, call.dz_desc, call.dz, call.bias) == (0, 0, 0, 0, 0)
        assert call.activation_desc == 0

        assert fields(call, "x dy dx") == pointers("input grad_output grad_input")
        assert fields(call, "scale dscale dbias") == pointers("weight grad_weight grad_bias")
        assert call.epsilon == 1e-3
        assert (call.saved_mean, call.saved_inv_variance) == (0, 0)  # train: recomputed
        assert (call.workspace, call.workspace_size) == (WORKSPACE, STUB_WORKSPACE)
        assert (call.reserve, call.reserve_size) == (0, 0)

        # The workspace was asked for the very descriptors the call got.
        assert query.calls == 1
        assert (query.handle, query.mode, query.bn_ops) == (call.handle, bn_mode, OPS_BN)
        descs = "x_desc dy_desc dx_desc bn_desc"
        assert fields(query, descs) == fields(call, descs)
        assert (query.y_desc, query.dz_desc, query.activation_desc) == (0, 0, 0)


@pytest.mark.parametrize("how", ["Mode.SAVED_INVSTD", "set_attributes"])
@pytest.mark.parametrize(("dtype", "channel_dtype"), FAST_DTYPES, ids=lambda d: d.name)
def test_saved_invstd_hands_cudnn_the_statistics(stub, how, dtype, channel_dtype):
    shape = (2, 3, 4, 5)
    if how == "set_attributes":
        desc = descriptor(shape, dtype, channel_dtype)
        desc.set_attributes(1e-4, "saved_invstd")
    else:
        desc = descriptor(shape, dtype, channel_dtype, eps=1e-4, mode=Mode.SAVED_INVSTD)
    with desc:
        assert (desc.engine, desc.workspace_size) == ("cudnn", STUB_WORKSPACE)
        compute(desc)
    call = stub.backward
    assert call.calls == 1
    assert fields(call, "saved_mean saved_inv_variance") == pointers("running_mean running_var")
    assert call.epsilon == 1e-4
    assert (call.alpha_data, call.beta_data, call.alpha_param, call.beta_param) == (1, 0, 1, 0)


def test_train_mode_takes_null_running_statistics(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        compute(desc, running_mean=0, running_var=0)
    assert stub.backward.calls == 1
    assert (stub.backward.saved_mean, stub.backward.saved_inv_variance) == (0, 0)


def test_stream_zero_is_the_legacy_default(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        compute(desc, stream=0)
    assert (stub.set_stream.calls, stub.set_stream.stream) == (1, 0)


def test_each_thread_uses_its_own_handle(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        compute(desc)
        first = stub.backward.handle
        worker = threading.Thread(target=compute, args=(desc,))
        worker.start()
        worker.join()
    assert stub.backward.calls == 2
    assert stub.backward.handle not in (0, first)
    assert stub.set_stream.handle == stub.backward.handle


SIZE_ONE_STRIDES = {  # (shape, strides of x; dy and dx packed), layout: a size-1 axis's
    # stride is never stepped, so it is free in memory but must be the packed one for cuDNN.
    "broadcast H (stride 0)": ((2, 3, 1, 5), (15, 5, 0, 1), "contiguous"),
    "N = 1 with a stray stride": ((1, 3, 4, 5), (999, 20, 5, 1), "contiguous"),
    "NHWC with H = 1": ((2, 3, 1, 5), (15, 1, 7, 3), "channels_last"),
}


@pytest.mark.parametrize(("shape", "strides", "layout"), SIZE_ONE_STRIDES.values(),
                         ids=list(SIZE_ONE_STRIDES))  # fmt: skip
def test_size_one_axes_get_packed_strides(stub, shape, strides, layout):
    packed = channels_last(shape) if layout == "channels_last" else contiguous_strides(shape)
    desc_tensors = tensors(shape, strides=packed)
    desc_tensors[3] = TensorDesc(F32, shape, strides)
    with BatchNormBackwardDescriptor(cudnn_bn.Handle(Device.NVIDIA, 0), *desc_tensors) as desc:
        assert desc.engine == "cudnn"
        compute(desc)
        expected = (CUDNN_FLOAT, shape, cudnn_strides(shape, layout))
        for name in ("x_desc", "dy_desc", "dx_desc"):  # read while the descriptors live
            assert stub.tensor(getattr(stub.backward, name)) == expected, name


# --- staging through the workspace: sizes only (the conversions are CuPy kernels) ----------


def _round_up(n: int) -> int:
    return -(-n // 256) * 256


@pytest.mark.parametrize(
    ("dtype", "channel_dtype", "mode", "slices"),
    [
        (F16, F16, "train", 3),  # weight in, grad_weight and grad_bias out, each as F32
        (F16, F16, "saved_invstd", 5),  # ... and running_mean, running_var in
        (F32, F32, "saved", 1),  # running_var in, as 1/sqrt(var + eps)
    ],
)
def test_staging_slices_follow_cudnn_workspace(stub, dtype, channel_dtype, mode, slices):
    channels = 3
    with descriptor((2, channels, 4, 5), dtype, channel_dtype, mode=mode) as desc:
        assert desc.engine == "cudnn"
        expected = STUB_WORKSPACE
        for _ in range(slices):  # F32 slices, each 256-byte aligned, after cuDNN's own
            expected = _round_up(expected) + 4 * channels
        assert desc.workspace_size == expected > STUB_WORKSPACE
        assert desc.reserve_size == STUB_RESERVE


# --- calls refused before cuDNN ------------------------------------------------------------


def test_small_workspace_is_refused_before_cudnn(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        with pytest.raises(InsufficientWorkspaceError) as caught:
            compute(desc, desc.workspace_size - 1)
        assert caught.value.status == Status.INSUFFICIENT_WORKSPACE
        with pytest.raises(NullPointerError):
            compute(desc, workspace=0)
    assert (stub.backward.calls, stub.set_stream.calls) == (0, 0)


@pytest.mark.parametrize(
    "name",
    ["grad_input", "grad_weight", "grad_bias", "input", "grad_output", "weight",
     "running_mean", "running_var"],
)  # fmt: skip
def test_null_data_pointer_is_refused_before_cudnn(stub, name):
    with (
        descriptor((2, 3, 4, 5), mode="saved_invstd") as desc,
        pytest.raises(NullPointerError, match=name),
    ):
        compute(desc, **{name: 0})
    assert (stub.backward.calls, stub.set_stream.calls) == (0, 0)


# --- which engine ---------------------------------------------------------------------------

BIG = 2**31  # elements: cuDNN indexes with 32 bits
ENGINES = {
    "F32 NCHW": ("cudnn", (2, 3, 4, 5), F32, {}, {}),
    "F16 NHWC": ("cudnn", (2, 3, 4, 5), F16, {"strides": channels_last((2, 3, 4, 5))}, {}),
    "eval": ("cupy", (2, 3, 4, 5), F32, {}, {"mode": "eval"}),
    "BF16": ("cupy", (2, 3, 4, 5), BF16, {}, {}),
    "BF16 with F32 statistics": ("cupy", (2, 3, 4, 5), BF16, {"channel_dtype": F32}, {}),
    "padded (13,2,4)/(10,4,1)": ("cupy", (13, 2, 4), F32, {"strides": (10, 4, 1)}, {}),
    "padded dy only": ("cupy", (13, 2, 4), F32, {"dy_strides": (10, 4, 1)}, {}),
    "NCHW x, NHWC dy": ("cupy", (2, 3, 4, 5), F32, {"dy_strides": channels_last((2, 3, 4, 5))}, {}),
    "numel 2^31": ("cupy", (2**16, 2**15), F32, {}, {}),
    "numel 2^31 + 2^16": ("cupy", (2**16, 2**15 + 1), F16, {"channel_dtype": F32}, {}),
    "eps 0 on cuDNN 9": ("cudnn", (2, 3, 4, 5), F32, {}, {"eps": 0.0}),
}


@pytest.mark.parametrize(("engine", "shape", "dtype", "layout", "attributes"), ENGINES.values(),
                         ids=list(ENGINES))  # fmt: skip
def test_engine_choice(stub, engine, shape, dtype, layout, attributes):
    before = stub.live_tensors.value
    with descriptor(shape, dtype, **layout, **attributes) as desc:
        assert desc.engine == engine
        if engine == "cupy":  # no cuDNN object and no size query behind a CuPy engine
            assert desc.reserve_size == 0
            assert (stub.live_tensors.value, stub.workspace_query.calls) == (before, 0)


def test_eps_below_cudnn8_floor_goes_to_cupy(stub, monkeypatch):
    cudnn8 = CudnnInfo(path="libcudnn.so.8", found_via="test stub", version=8907)
    monkeypatch.setattr(library_module.cudnn(), "info", cudnn8)
    with descriptor((2, 3, 4, 5), eps=1e-6) as desc:
        assert desc.engine == "cupy"
    with descriptor((2, 3, 4, 5), eps=1e-5) as desc:
        assert desc.engine == "cudnn"


# --- a cuDNN failure ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error"), [(3003, BadTensorDtypeError), (3002, BadTensorShapeError)]
)
def test_cudnn_failure_raises_with_its_strings_and_a_repro(stub, code, error):
    stub.backward_status.value = code
    with descriptor((2, 3, 4, 5), F16, F32, eps=1e-3) as desc, pytest.raises(error) as caught:
        compute(desc)
    message = str(caught.value)
    assert "cudnnBatchNormalizationBackwardEx" in message
    assert f"STUB_STATUS_{code} ({code})" in message  # cudnnGetErrorString
    assert f"stub detail for {code}" in message  # cudnnGetLastErrorString
    assert "To reproduce" in message
    assert "shape (2, 3, 4, 5)" in message
    assert "eps=0.001" in message and "mode='train'" in message
    assert stub.backward.calls == 1


# --- lifetimes ------------------------------------------------------------------------------


def test_cudnn_descriptors_are_destroyed_with_the_operator(stub):
    gc.collect()
    before = stub.live_tensors.value
    desc = descriptor((2, 3, 4, 5))
    assert stub.live_tensors.value == before + 4  # x, dy, dx and the derived one
    desc.set_attributes(1e-3, "saved_invstd")  # rebuilt: the old ones are destroyed
    assert stub.live_tensors.value == before + 4
    desc.destroy()
    assert stub.live_tensors.value == before
    with pytest.raises(BadParamError):
        desc.destroy()
    with pytest.raises(BadParamError):
        compute(desc, STUB_WORKSPACE)
    assert stub.backward.calls == 0


# --- the C API ------------------------------------------------------------------------------


def _capi_tensor(desc: TensorDesc) -> c_void_p:
    out, n = c_void_p(), desc.ndim
    shape, strides = (c_size_t * n)(*desc.shape), (c_ssize_t * n)(*desc.strides)
    status = capi.infiniopCreateTensorDescriptor(ctypes.byref(out), n, shape, strides, desc.dtype)
    assert status == Status.SUCCESS, capi.last_error()
    return out


def test_capi_hands_cudnn_the_same_arguments(stub):
    assert capi.infinirtSetDevice(Device.NVIDIA, 1) == Status.DEVICE_NOT_FOUND  # one device
    assert capi.infinirtSetDevice(Device.NVIDIA, 0) == Status.SUCCESS
    handle, desc, size = c_void_p(), c_void_p(), c_size_t()
    assert capi.infiniopCreateHandle(ctypes.byref(handle)) == Status.SUCCESS
    shape = (2, 3, 4, 5)
    descs = [_capi_tensor(d) for d in tensors(shape, F16, F32, strides=channels_last(shape))]
    status = capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(desc), *descs)
    assert status == Status.SUCCESS, capi.last_error()
    assert capi.infiniopSetBatchNormBackwardAttributes(desc, 1e-3, 3) == Status.SUCCESS
    assert capi.infiniopGetBatchNormBackwardWorkspaceSize(desc, ctypes.byref(size)) == 0
    assert size.value == STUB_WORKSPACE

    ptrs = [c_void_p(POINTERS[name]) for name in ARGUMENTS]
    args = (desc, c_void_p(WORKSPACE), size.value, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormBackward(*args) == Status.SUCCESS, capi.last_error()
    call = stub.backward
    assert call.calls == 1
    assert stub.set_stream.stream == STREAM
    assert (call.mode, call.epsilon) == (SPATIAL, 1e-3)
    assert stub.tensor(call.x_desc) == (CUDNN_HALF, shape, channels_last(shape))
    assert fields(call, "x dy dx") == pointers("input grad_output grad_input")
    assert fields(call, "scale dscale dbias") == pointers("weight grad_weight grad_bias")
    assert fields(call, "saved_mean saved_inv_variance") == pointers("running_mean running_var")
    assert (call.workspace, call.workspace_size) == (WORKSPACE, STUB_WORKSPACE)

    # Refused before cuDNN: a small workspace, a NULL input.
    small = (desc, c_void_p(WORKSPACE), size.value - 1, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormBackward(*small) == Status.INSUFFICIENT_WORKSPACE
    null_x = (*args[:6], None, *args[7:])
    assert capi.infiniopBatchNormBackward(*null_x) == Status.NULL_POINTER
    assert "input is NULL" in capi.last_error()
    assert call.calls == 1

    # A cuDNN failure: its status, strings and the repro, through last_error().
    stub.backward_status.value = 3003
    assert capi.infiniopBatchNormBackward(*args) == Status.BAD_TENSOR_DTYPE
    assert "STUB_STATUS_3003" in capi.last_error() and "To reproduce" in capi.last_error()

    assert capi.infiniopDestroyBatchNormBackwardDescriptor(desc) == Status.SUCCESS
    assert capi.infiniopDestroyBatchNormBackwardDescriptor(desc) == Status.BAD_PARAM
    for d in descs:
        assert capi.infiniopDestroyTensorDescriptor(d) == Status.SUCCESS
    assert capi.infiniopDestroyHandle(handle) == Status.SUCCESS
