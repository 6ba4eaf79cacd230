"""The one table of cuDNN functions this package calls: name -> (restype, argtypes).

Each entry carries its C prototype as a comment. Opaque cuDNN objects get distinct pointer
types, so passing a handle where a tensor descriptor belongs is a ``TypeError`` from ctypes,
not memory corruption. Entries returning ``cudnnStatus_t`` are checked by one checker
(``library.py``); ``tests/test_prototypes.py`` checks argument counts against the header.
"""

import ctypes
from ctypes import POINTER, c_char_p, c_double, c_int, c_size_t, c_void_p


def _opaque(struct_name: str) -> type:
    return POINTER(type(struct_name, (ctypes.Structure,), {}))


cudnnStatus_t = c_int
cudnnHandle_t = _opaque("cudnnContext")
cudnnTensorDescriptor_t = _opaque("cudnnTensorStruct")
cudnnActivationDescriptor_t = _opaque("cudnnActivationStruct")
cudnnRuntimeTag_p = _opaque("cudnnRuntimeTag_t")  # cudnnRuntimeTag_t * (always NULL)
cudaStream_t = c_void_p
# Enum arguments (cudnnDataType_t, cudnnBatchNormMode_t, ...) are C ints.
enum_t = c_int

_T = cudnnTensorDescriptor_t
_A = cudnnActivationDescriptor_t
_H = cudnnHandle_t
_p = c_void_p  # device data pointers and pointers to host alpha/beta scalars

PROTOTYPES: dict[str, tuple[type | None, tuple[type, ...]]] = {
    # size_t cudnnGetVersion(void)
    "cudnnGetVersion": (c_size_t, ()),
    # size_t cudnnGetCudartVersion(void)
    "cudnnGetCudartVersion": (c_size_t, ()),
    # const char *cudnnGetErrorString(cudnnStatus_t status)
    "cudnnGetErrorString": (c_char_p, (cudnnStatus_t,)),
    # void cudnnGetLastErrorString(char *message, size_t max_size)  (cuDNN 9 only)
    "cudnnGetLastErrorString": (None, (c_char_p, c_size_t)),
    # cudnnStatus_t cudnnCreate(cudnnHandle_t *handle)
    "cudnnCreate": (cudnnStatus_t, (POINTER(_H),)),
    # cudnnStatus_t cudnnDestroy(cudnnHandle_t handle)
    "cudnnDestroy": (cudnnStatus_t, (_H,)),
    # cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId)
    "cudnnSetStream": (cudnnStatus_t, (_H, cudaStream_t)),
    # cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t *streamId)
    "cudnnGetStream": (cudnnStatus_t, (_H, POINTER(cudaStream_t))),
    # cudnnStatus_t cudnnQueryRuntimeError(cudnnHandle_t handle, cudnnStatus_t *rstatus,
    #     cudnnErrQueryMode_t mode, cudnnRuntimeTag_t *tag)  (deprecated in cuDNN 9, kept)
    "cudnnQueryRuntimeError": (
        cudnnStatus_t,
        (_H, POINTER(cudnnStatus_t), enum_t, cudnnRuntimeTag_p),
    ),
    # cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *tensorDesc)
    "cudnnCreateTensorDescriptor": (cudnnStatus_t, (POINTER(_T),)),
    # cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t tensorDesc)
    "cudnnDestroyTensorDescriptor": (cudnnStatus_t, (_T,)),
    # cudnnStatus_t cudnnSetTensorNdDescriptor(cudnnTensorDescriptor_t tensorDesc,
    #     cudnnDataType_t dataType, int nbDims, const int dimA[], const int strideA[])
    "cudnnSetTensorNdDescriptor": (
        cudnnStatus_t,
        (_T, enum_t, c_int, POINTER(c_int), POINTER(c_int)),
    ),
    # cudnnStatus_t cudnnGetTensorNdDescriptor(const cudnnTensorDescriptor_t tensorDesc,
    #     int nbDimsRequested, cudnnDataType_t *dataType, int *nbDims, int dimA[], int strideA[])
    "cudnnGetTensorNdDescriptor": (
        cudnnStatus_t,
        (_T, c_int, POINTER(enum_t), POINTER(c_int), POINTER(c_int), POINTER(c_int)),
    ),
    # cudnnStatus_t cudnnCreateActivationDescriptor(cudnnActivationDescriptor_t *activationDesc)
    "cudnnCreateActivationDescriptor": (cudnnStatus_t, (POINTER(_A),)),
    # cudnnStatus_t cudnnSetActivationDescriptor(cudnnActivationDescriptor_t activationDesc,
    #     cudnnActivationMode_t mode, cudnnNanPropagation_t reluNanOpt, double coef)
    "cudnnSetActivationDescriptor": (cudnnStatus_t, (_A, enum_t, enum_t, c_double)),
    # cudnnStatus_t cudnnDestroyActivationDescriptor(cudnnActivationDescriptor_t activationDesc)
    "cudnnDestroyActivationDescriptor": (cudnnStatus_t, (_A,)),
    # cudnnStatus_t cudnnDeriveBNTensorDescriptor(cudnnTensorDescriptor_t derivedBnDesc,
    #     const cudnnTensorDescriptor_t xDesc, cudnnBatchNormMode_t mode)
    "cudnnDeriveBNTensorDescriptor": (cudnnStatus_t, (_T, _T, enum_t)),
    # cudnnStatus_t cudnnBatchNormalizationForwardInference(cudnnHandle_t handle,
    #     cudnnBatchNormMode_t mode, const void *alpha, const void *beta,
    #     const cudnnTensorDescriptor_t xDesc, const void *x,
    #     const cudnnTensorDescriptor_t yDesc, void *y,
    #     const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
    #     const void *bnBias, const void *estimatedMean, const void *estimatedVariance,
    #     double epsilon)
    "cudnnBatchNormalizationForwardInference": (
        cudnnStatus_t,
        (_H, enum_t, _p, _p, _T, _p, _T, _p, _T, _p, _p, _p, _p, c_double),
    ),
    # cudnnStatus_t cudnnBatchNormalizationForwardTraining(cudnnHandle_t handle,
    #     cudnnBatchNormMode_t mode, const void *alpha, const void *beta,
    #     const cudnnTensorDescriptor_t xDesc, const void *x,
    #     const cudnnTensorDescriptor_t yDesc, void *y,
    #     const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
    #     const void *bnBias, double exponentialAverageFactor, void *resultRunningMean,
    #     void *resultRunningVariance, double epsilon, void *resultSaveMean,
    #     void *resultSaveInvVariance)
    "cudnnBatchNormalizationForwardTraining": (
        cudnnStatus_t,
        (_H, enum_t, _p, _p, _T, _p, _T, _p, _T, _p, _p, c_double, _p, _p, c_double, _p, _p),
    ),
    # cudnnStatus_t cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
    #     cudnnHandle_t handle, cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps,
    #     const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t zDesc,
    #     const cudnnTensorDescriptor_t yDesc,
    #     const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc,
    #     const cudnnActivationDescriptor_t activationDesc, size_t *sizeInBytes)
    "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize": (
        cudnnStatus_t,
        (_H, enum_t, enum_t, _T, _T, _T, _T, _A, POINTER(c_size_t)),
    ),
    # cudnnStatus_t cudnnGetBatchNormalizationBackwardExWorkspaceSize(cudnnHandle_t handle,
    #     cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps,
    #     const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t yDesc,
    #     const cudnnTensorDescriptor_t dyDesc, const cudnnTensorDescriptor_t dzDesc,
    #     const cudnnTensorDescriptor_t dxDesc, const cudnnTensorDescriptor_t dBnScaleBiasDesc,
    #     const cudnnActivationDescriptor_t activationDesc, size_t *sizeInBytes)
    "cudnnGetBatchNormalizationBackwardExWorkspaceSize": (
        cudnnStatus_t,
        (_H, enum_t, enum_t, _T, _T, _T, _T, _T, _T, _A, POINTER(c_size_t)),
    ),
    # cudnnStatus_t cudnnGetBatchNormalizationTrainingExReserveSpaceSize(cudnnHandle_t handle,
    #     cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps,
    #     const cudnnActivationDescriptor_t activationDesc,
    #     const cudnnTensorDescriptor_t xDesc, size_t *sizeInBytes)
    "cudnnGetBatchNormalizationTrainingExReserveSpaceSize": (
        cudnnStatus_t,
        (_H, enum_t, enum_t, _A, _T, POINTER(c_size_t)),
    ),
    # cudnnStatus_t cudnnBatchNormalizationForwardTrainingEx(cudnnHandle_t handle,
    #     cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const void *alpha,
    #     const void *beta, const cudnnTensorDescriptor_t xDesc, const void *xData,
    #     const cudnnTensorDescriptor_t zDesc, const void *zData,
    #     const cudnnTensorDescriptor_t yDesc, void *yData,
    #     const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc, const void *bnScale,
    #     const void *bnBias, double exponentialAverageFactor, void *resultRunningMean,
    #     void *resultRunningVariance, double epsilon, void *resultSaveMean,
    #     void *resultSaveInvVariance, cudnnActivationDescriptor_t activationDesc,
    #     void *workspace, size_t workSpaceSizeInBytes, void *reserveSpace,
    #     size_t reserveSpaceSizeInBytes)
    "cudnnBatchNormalizationForwardTrainingEx": (
        cudnnStatus_t,
        (
            _H,
            enum_t,
            enum_t,
            _p,
            _p,
            _T,
            _p,
            _T,
            _p,
            _T,
            _p,
            _T,
            _p,
            _p,
            c_double,
            _p,
            _p,
            c_double,
            _p,
            _p,
            _A,
            _p,
            c_size_t,
            _p,
            c_size_t,
        ),
    ),
    # cudnnStatus_t cudnnBatchNormalizationBackward(cudnnHandle_t handle,
    #     cudnnBatchNormMode_t mode, const void *alphaDataDiff, const void *betaDataDiff,
    #     const void *alphaParamDiff, const void *betaParamDiff,
    #     const cudnnTensorDescriptor_t xDesc, const void *x,
    #     const cudnnTensorDescriptor_t dyDesc, const void *dy,
    #     const cudnnTensorDescriptor_t dxDesc, void *dx,
    #     const cudnnTensorDescriptor_t dBnScaleBiasDesc, const void *bnScale,
    #     void *dBnScaleResult, void *dBnBiasResult, double epsilon, const void *savedMean,
    #     const void *savedInvVariance)
    "cudnnBatchNormalizationBackward": (
        cudnnStatus_t,
        (_H, enum_t, _p, _p, _p, _p, _T, _p, _T, _p, _T, _p, _T, _p, _p, _p, c_double, _p, _p),
    ),
    # cudnnStatus_t cudnnBatchNormalizationBackwardEx(cudnnHandle_t handle,
    #     cudnnBatchNormMode_t mode, cudnnBatchNormOps_t bnOps, const void *alphaDataDiff,
    #     const void *betaDataDiff, const void *alphaParamDiff, const void *betaParamDiff,
    #     const cudnnTensorDescriptor_t xDesc, const void *xData,
    #     const cudnnTensorDescriptor_t yDesc, const void *yData,
    #     const cudnnTensorDescriptor_t dyDesc, const void *dyData,
    #     const cudnnTensorDescriptor_t dzDesc, void *dzData,
    #     const cudnnTensorDescriptor_t dxDesc, void *dxData,
    #     const cudnnTensorDescriptor_t dBnScaleBiasDesc, const void *bnScaleData,
    #     const void *bnBiasData, void *dBnScaleData, void *dBnBiasData, double epsilon,
    #     const void *savedMean, const void *savedInvVariance,
    #     const cudnnActivationDescriptor_t activationDesc, void *workSpace,
    #     size_t workSpaceSizeInBytes, void *reserveSpace, size_t reserveSpaceSizeInBytes)
    "cudnnBatchNormalizationBackwardEx": (
        cudnnStatus_t,
        (
            _H,
            enum_t,
            enum_t,
            _p,
            _p,
            _p,
            _p,
            _T,
            _p,
            _T,
            _p,
            _T,
            _p,
            _T,
            _p,
            _T,
            _p,
            _T,
            _p,
            _p,
            _p,
            _p,
            c_double,
            _p,
            _p,
            _A,
            _p,
            c_size_t,
            _p,
            c_size_t,
        ),
    ),
}
