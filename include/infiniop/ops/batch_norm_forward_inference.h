/**
 * @file infiniop/ops/batch_norm_forward_inference.h
 * @brief Inference-mode batch-norm forward:
 * y = (x - running_mean) / sqrt(running_var + eps) * weight + bias, with fixed statistics.
 *
 * Statistics are per channel (axis 1). Tensor arguments:
 *
 * - input, output: shape (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W). Both have
 *   the same shape and the same dtype. Any non-negative strides are accepted; output must
 *   not overlap itself.
 * - weight, bias, running_mean, running_var ("per-channel"): shape (C), any positive
 *   stride.
 *
 * Dtypes: INFINI_DTYPE_F16, INFINI_DTYPE_F32, INFINI_DTYPE_BF16 or INFINI_DTYPE_F64.
 * The per-channel tensors either share the input's dtype or, for F16/BF16 input, are
 * INFINI_DTYPE_F32. Accumulation is in at least single precision.
 *
 * Empty batch (no values per channel: N = 0 or a spatial size 0; C must be > 0): nothing
 * is written, as PyTorch; data pointers may be NULL.
 *
 * Call order: infiniopCreateBatchNormForwardInferenceDescriptor(),
 * infiniopSetBatchNormForwardInferenceAttributes() (optional),
 * infiniopGetBatchNormForwardInferenceWorkspaceSize(), infiniopBatchNormForwardInference()
 * any number of times, infiniopDestroyBatchNormForwardInferenceDescriptor().
 */
#ifndef INFINIOP_OPS_BATCH_NORM_FORWARD_INFERENCE_H
#define INFINIOP_OPS_BATCH_NORM_FORWARD_INFERENCE_H

#include <stddef.h>

#include "../../infinicore.h"
#include "../handle.h"
#include "../tensor_descriptor.h"

#ifdef __cplusplus
extern "C" {
#endif

/** @brief Opaque inference-mode batch-norm forward descriptor: validated arguments and
 *  cached sizes. */
typedef struct InfiniopBatchNormForwardInferenceDescriptor
    *infiniopBatchNormForwardInferenceDescriptor_t;

/**
 * @brief Validate the arguments of an inference-mode batch-norm forward and create its
 * descriptor.
 *
 * Everything that can be checked without data is checked here. On INFINI_DEVICE_NVIDIA
 * the cuDNN tensor descriptors are built and the workspace size is queried once. The
 * tensor descriptors are not retained and may be destroyed after this call.
 *
 * @param handle            Handle of the device the computation runs on.
 * @param desc_ptr          Out: receives the new descriptor. Must not be NULL.
 * @param output_desc       Output y; same shape and dtype as input, must not overlap itself.
 * @param input_desc        Input x, shape (N, C, ...).
 * @param weight_desc       Weight (gamma), shape (C).
 * @param bias_desc         Bias (beta), shape (C).
 * @param running_mean_desc Running mean, shape (C).
 * @param running_var_desc  Running variance, shape (C).
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if handle, desc_ptr or a tensor descriptor is NULL;
 *         INFINI_STATUS_BAD_PARAM if handle or a tensor descriptor is unknown or destroyed;
 *         INFINI_STATUS_BAD_TENSOR_SHAPE if a rank or shape is not accepted or the shapes
 *         disagree;
 *         INFINI_STATUS_BAD_TENSOR_DTYPE if a dtype is not accepted or the dtypes disagree;
 *         INFINI_STATUS_BAD_TENSOR_STRIDES if a stride is negative, a per-channel stride is
 *         not positive, or output overlaps itself;
 *         INFINI_STATUS_DEVICE_TYPE_NOT_SUPPORTED if the handle's device is not served;
 *         INFINI_STATUS_DEVICE_NOT_INITIALIZED if cuDNN cannot be loaded or initialized;
 *         other codes mapped from a cuDNN failure (INFINI_STATUS_NOT_IMPLEMENTED,
 *         INFINI_STATUS_INTERNAL_ERROR, ...).
 */
infiniStatus_t infiniopCreateBatchNormForwardInferenceDescriptor(
    infiniopHandle_t handle,
    infiniopBatchNormForwardInferenceDescriptor_t *desc_ptr,
    infiniopTensorDescriptor_t output_desc,
    infiniopTensorDescriptor_t input_desc,
    infiniopTensorDescriptor_t weight_desc,
    infiniopTensorDescriptor_t bias_desc,
    infiniopTensorDescriptor_t running_mean_desc,
    infiniopTensorDescriptor_t running_var_desc);

/**
 * @brief Set epsilon. Optional: the default is 1e-5.
 *
 * Call it before infiniopGetBatchNormForwardInferenceWorkspaceSize() and before the first
 * infiniopBatchNormForwardInference() on desc.
 *
 * @param desc Descriptor from infiniopCreateBatchNormForwardInferenceDescriptor().
 * @param eps  Added to the variance before the square root; finite and >= 0 (0 is allowed).
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed, or eps is negative, NaN
 *         or infinite;
 *         other codes of infiniopCreateBatchNormForwardInferenceDescriptor() where preparing
 *         the computation for the new eps fails (INFINI_STATUS_DEVICE_NOT_INITIALIZED, ...).
 */
infiniStatus_t infiniopSetBatchNormForwardInferenceAttributes(
    infiniopBatchNormForwardInferenceDescriptor_t desc,
    double eps);

/**
 * @brief Size in bytes of the workspace infiniopBatchNormForwardInference() needs.
 *
 * @param desc Descriptor from infiniopCreateBatchNormForwardInferenceDescriptor().
 * @param size Out: receives the size in bytes (may be 0). Must not be NULL.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc or size is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed.
 */
infiniStatus_t infiniopGetBatchNormForwardInferenceWorkspaceSize(
    infiniopBatchNormForwardInferenceDescriptor_t desc,
    size_t *size);

/**
 * @brief Compute output.
 *
 * Data pointers are host addresses on INFINI_DEVICE_CPU and device addresses on
 * INFINI_DEVICE_NVIDIA, laid out as the descriptor's tensor descriptors say. The call
 * neither allocates nor synchronizes: on NVIDIA the work is queued on stream, so it can
 * be captured in a CUDA graph. The output must not alias the inputs.
 *
 * @param desc           Descriptor from infiniopCreateBatchNormForwardInferenceDescriptor().
 * @param workspace      Scratch memory on the descriptor's device, at least the size
 *                       infiniopGetBatchNormForwardInferenceWorkspaceSize() reported; may be
 *                       NULL when that size is 0.
 * @param workspace_size Size of workspace in bytes.
 * @param output         Output y.
 * @param input          Input x.
 * @param weight         Weight (gamma).
 * @param bias           Bias (beta).
 * @param running_mean   Running mean.
 * @param running_var    Running variance.
 * @param stream         cudaStream_t to run on (NULL: the default stream) on
 *                       INFINI_DEVICE_NVIDIA; ignored on INFINI_DEVICE_CPU.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc or a data pointer is NULL, or workspace is NULL
 *         while the required size is not 0;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed, a data pointer is not
 *         aligned to its elements, or an output overlaps another argument other than
 *         in place (a data output exactly on a read data tensor of its layout, or on the
 *         CPU over one in any way); nothing is written;
 *         INFINI_STATUS_INSUFFICIENT_WORKSPACE if workspace_size is smaller than the
 *         reported size (nothing is written);
 *         INFINI_STATUS_BAD_TENSOR_DTYPE if cuDNN rejects a dtype;
 *         INFINI_STATUS_INTERNAL_ERROR, or another code mapped from a cuDNN failure.
 */
infiniStatus_t infiniopBatchNormForwardInference(
    infiniopBatchNormForwardInferenceDescriptor_t desc,
    void *workspace,
    size_t workspace_size,
    void *output,
    const void *input,
    const void *weight,
    const void *bias,
    const void *running_mean,
    const void *running_var,
    void *stream);

/**
 * @brief Destroy a descriptor and release what it holds.
 *
 * @param desc Descriptor from infiniopCreateBatchNormForwardInferenceDescriptor(); invalid
 *             afterwards.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or already destroyed.
 */
infiniStatus_t infiniopDestroyBatchNormForwardInferenceDescriptor(
    infiniopBatchNormForwardInferenceDescriptor_t desc);

#ifdef __cplusplus
}
#endif

#endif /* INFINIOP_OPS_BATCH_NORM_FORWARD_INFERENCE_H */
