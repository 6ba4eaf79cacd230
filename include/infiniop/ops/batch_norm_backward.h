/**
 * @file infiniop/ops/batch_norm_backward.h
 * @brief Batch-norm backward: gradients of y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias
 * with respect to x, weight and bias.
 *
 * Statistics are per channel (axis 1) over every other axis. Tensor arguments:
 *
 * - input, grad_output, grad_input: shape (N, C, L) as in the operator specification;
 *   (N, C), (N, C, H, W) and (N, C, D, H, W) are accepted too. All three have the same
 *   shape and the same dtype. Any non-negative strides are accepted; grad_input must not
 *   overlap itself.
 * - weight, running_mean, running_var, grad_weight, grad_bias ("per-channel"): shape (C),
 *   any positive stride.
 *
 * Dtypes: INFINI_DTYPE_F16, INFINI_DTYPE_F32, INFINI_DTYPE_BF16 or INFINI_DTYPE_F64.
 * The per-channel tensors either share the input's dtype or, for F16/BF16 input, are all
 * INFINI_DTYPE_F32. Accumulation is in at least single precision.
 *
 * Outputs, in every mode: grad_bias = sum(grad_output) and
 * grad_weight = sum(grad_output * xhat) per channel, where xhat = (input - mean) * invstd.
 *
 * Empty batch (no values per channel: N = 0 or a spatial size 0; C must be > 0), as
 * PyTorch: grad_weight and grad_bias are zeros (written on the stream), grad_input is
 * empty; data pointers may be NULL.
 *
 * Call order: infiniopCreateBatchNormBackwardDescriptor(),
 * infiniopSetBatchNormBackwardAttributes() (optional),
 * infiniopGetBatchNormBackwardWorkspaceSize(), infiniopBatchNormBackward() any number of
 * times, infiniopDestroyBatchNormBackwardDescriptor().
 */
#ifndef INFINIOP_OPS_BATCH_NORM_BACKWARD_H
#define INFINIOP_OPS_BATCH_NORM_BACKWARD_H

#include <stddef.h>

#include "../../infinicore.h"
#include "../handle.h"
#include "../tensor_descriptor.h"

#ifdef __cplusplus
extern "C" {
#endif

/** @brief Opaque batch-norm backward descriptor: validated arguments and cached sizes. */
typedef struct InfiniopBatchNormBackwardDescriptor *infiniopBatchNormBackwardDescriptor_t;

/**
 * @brief Which statistics the backward pass uses; the mode argument of
 * infiniopSetBatchNormBackwardAttributes().
 */
typedef enum {
    /** Mean and biased variance of input, recomputed over all axes but C (training-mode
     *  backward). running_mean and running_var are checked for shape and dtype but not read. */
    INFINIOP_BATCH_NORM_BACKWARD_MODE_TRAIN = 0,
    /** running_mean is the batch mean and running_var the biased batch variance saved by the
     *  forward pass; invstd = 1 / sqrt(running_var + eps). Training formula for grad_input. */
    INFINIOP_BATCH_NORM_BACKWARD_MODE_SAVED = 1,
    /** running_mean and running_var are fixed running statistics (inference-mode backward):
     *  grad_input = grad_output * weight * invstd, with no mean-of-grad_output terms. */
    INFINIOP_BATCH_NORM_BACKWARD_MODE_EVAL = 2,
    /** Like SAVED, but running_var holds invstd = 1 / sqrt(var + eps) as the forward pass
     *  saved it (cuDNN's and PyTorch's saved statistics); used as given, eps not applied. */
    INFINIOP_BATCH_NORM_BACKWARD_MODE_SAVED_INVSTD = 3
} infiniopBatchNormBackwardMode_t;

/**
 * @brief Validate the arguments of a batch-norm backward and create its descriptor.
 *
 * Everything that can be checked without data is checked here. On INFINI_DEVICE_NVIDIA
 * the cuDNN tensor descriptors are built and the workspace size is queried once. The
 * tensor descriptors are not retained and may be destroyed after this call.
 *
 * @param handle            Handle of the device the computation runs on.
 * @param desc_ptr          Out: receives the new descriptor. Must not be NULL.
 * @param grad_input_desc   Output: gradient with respect to input; same shape and dtype as
 *                          input, must not overlap itself.
 * @param grad_weight_desc  Output: gradient with respect to weight, shape (C).
 * @param grad_bias_desc    Output: gradient with respect to bias, shape (C).
 * @param input_desc        Input x of the forward pass, shape (N, C, ...).
 * @param grad_output_desc  Gradient with respect to the forward output y; same shape and
 *                          dtype as input.
 * @param weight_desc       Weight (gamma) of the forward pass, shape (C).
 * @param running_mean_desc Mean statistic, shape (C); its meaning depends on the mode
 *                          (infiniopBatchNormBackwardMode_t). May be NULL for a
 *                          descriptor used only in INFINIOP_BATCH_NORM_BACKWARD_MODE_TRAIN,
 *                          which does not read it.
 * @param running_var_desc  Variance statistic (invstd in MODE_SAVED_INVSTD), shape (C).
 *                          May be NULL as running_mean_desc may.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if handle, desc_ptr or a tensor descriptor other than
 *         running_mean_desc and running_var_desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if handle or a tensor descriptor is unknown or destroyed;
 *         INFINI_STATUS_BAD_TENSOR_SHAPE if a rank or shape is not accepted or the shapes
 *         disagree;
 *         INFINI_STATUS_BAD_TENSOR_DTYPE if a dtype is not accepted or the dtypes disagree;
 *         INFINI_STATUS_BAD_TENSOR_STRIDES if a stride is negative, a per-channel stride is
 *         not positive, or grad_input overlaps itself;
 *         INFINI_STATUS_DEVICE_TYPE_NOT_SUPPORTED if the handle's device is not served;
 *         INFINI_STATUS_DEVICE_NOT_INITIALIZED if cuDNN cannot be loaded or initialized;
 *         other codes mapped from a cuDNN failure (INFINI_STATUS_NOT_IMPLEMENTED,
 *         INFINI_STATUS_INTERNAL_ERROR, ...).
 */
infiniStatus_t infiniopCreateBatchNormBackwardDescriptor(
    infiniopHandle_t handle,
    infiniopBatchNormBackwardDescriptor_t *desc_ptr,
    infiniopTensorDescriptor_t grad_input_desc,
    infiniopTensorDescriptor_t grad_weight_desc,
    infiniopTensorDescriptor_t grad_bias_desc,
    infiniopTensorDescriptor_t input_desc,
    infiniopTensorDescriptor_t grad_output_desc,
    infiniopTensorDescriptor_t weight_desc,
    infiniopTensorDescriptor_t running_mean_desc,
    infiniopTensorDescriptor_t running_var_desc);

/**
 * @brief Set epsilon and the mode. Optional: the defaults are eps 1e-5 and
 * INFINIOP_BATCH_NORM_BACKWARD_MODE_TRAIN.
 *
 * Call it before infiniopGetBatchNormBackwardWorkspaceSize() and before the first
 * infiniopBatchNormBackward() on desc: the workspace size may depend on the mode.
 *
 * @param desc Descriptor from infiniopCreateBatchNormBackwardDescriptor().
 * @param eps  Added to the variance before the square root; finite and >= 0 (0 is allowed).
 * @param mode An infiniopBatchNormBackwardMode_t value.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL, or mode reads statistics and desc was
 *         created without running_mean_desc or running_var_desc;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed, eps is negative, NaN or
 *         infinite, or mode is not an infiniopBatchNormBackwardMode_t value;
 *         other codes of infiniopCreateBatchNormBackwardDescriptor() where preparing the
 *         computation for the new mode fails (INFINI_STATUS_DEVICE_NOT_INITIALIZED, ...).
 */
infiniStatus_t infiniopSetBatchNormBackwardAttributes(
    infiniopBatchNormBackwardDescriptor_t desc,
    double eps,
    int mode);

/**
 * @brief Size in bytes of the workspace infiniopBatchNormBackward() needs.
 *
 * @param desc Descriptor from infiniopCreateBatchNormBackwardDescriptor().
 * @param size Out: receives the size in bytes (may be 0). Must not be NULL.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc or size is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed.
 */
infiniStatus_t infiniopGetBatchNormBackwardWorkspaceSize(
    infiniopBatchNormBackwardDescriptor_t desc,
    size_t *size);

/**
 * @brief Compute grad_input, grad_weight and grad_bias.
 *
 * Data pointers are host addresses on INFINI_DEVICE_CPU and device addresses on
 * INFINI_DEVICE_NVIDIA, laid out as the descriptor's tensor descriptors say. The call
 * neither allocates nor synchronizes: on NVIDIA the work is queued on stream, so it can
 * be captured in a CUDA graph. The outputs must not alias the inputs.
 *
 * @param desc           Descriptor from infiniopCreateBatchNormBackwardDescriptor().
 * @param workspace      Scratch memory on the descriptor's device, at least the size
 *                       infiniopGetBatchNormBackwardWorkspaceSize() reported; may be NULL
 *                       when that size is 0.
 * @param workspace_size Size of workspace in bytes.
 * @param grad_input     Output: gradient with respect to input.
 * @param grad_weight    Output: gradient with respect to weight.
 * @param grad_bias      Output: gradient with respect to bias.
 * @param input          Input x of the forward pass.
 * @param grad_output    Gradient with respect to the forward output.
 * @param weight         Weight (gamma).
 * @param running_mean   Mean statistic; not read in INFINIOP_BATCH_NORM_BACKWARD_MODE_TRAIN.
 * @param running_var    Variance statistic (invstd in MODE_SAVED_INVSTD); not read in
 *                       INFINIOP_BATCH_NORM_BACKWARD_MODE_TRAIN.
 * @param stream         cudaStream_t to run on (NULL: the default stream) on
 *                       INFINI_DEVICE_NVIDIA; ignored on INFINI_DEVICE_CPU.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL, a data pointer the mode reads or
 *         writes is NULL, or workspace is NULL while the required size is not 0;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed, a data pointer is not
 *         aligned to its elements, or an output overlaps another argument other than
 *         in place (a data output exactly on a read data tensor of its layout, or on the
 *         CPU over one in any way); nothing is written;
 *         INFINI_STATUS_INSUFFICIENT_WORKSPACE if workspace_size is smaller than the
 *         reported size (nothing is written);
 *         INFINI_STATUS_BAD_TENSOR_DTYPE if cuDNN rejects a dtype;
 *         INFINI_STATUS_INTERNAL_ERROR, or another code mapped from a cuDNN failure.
 */
infiniStatus_t infiniopBatchNormBackward(
    infiniopBatchNormBackwardDescriptor_t desc,
    void *workspace,
    size_t workspace_size,
    void *grad_input,
    void *grad_weight,
    void *grad_bias,
    const void *input,
    const void *grad_output,
    const void *weight,
    const void *running_mean,
    const void *running_var,
    void *stream);

/**
 * @brief Destroy a descriptor and release what it holds.
 *
 * @param desc Descriptor from infiniopCreateBatchNormBackwardDescriptor(); invalid afterwards.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or already destroyed.
 */
infiniStatus_t infiniopDestroyBatchNormBackwardDescriptor(
    infiniopBatchNormBackwardDescriptor_t desc);

#ifdef __cplusplus
}
#endif

#endif /* INFINIOP_OPS_BATCH_NORM_BACKWARD_H */
