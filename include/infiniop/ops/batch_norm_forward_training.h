/**
 * @file infiniop/ops/batch_norm_forward_training.h
 * @brief Training-mode batch-norm forward: y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias
 * with the statistics of the batch, which are saved for the backward pass and folded into
 * the running statistics.
 *
 * Statistics are per channel (axis 1) over every other axis. Tensor arguments:
 *
 * - input, output: shape (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W), C > 0, with
 *   other than one value per channel (N times the spatial sizes != 1). Both have the same
 *   shape and the same dtype. Any non-negative strides are accepted; output must not
 *   overlap itself.
 * - weight, bias, saved_mean, saved_invstd, running_mean, running_var ("per-channel"):
 *   shape (C), any positive stride.
 *
 * Dtypes: INFINI_DTYPE_F16, INFINI_DTYPE_F32, INFINI_DTYPE_BF16 or INFINI_DTYPE_F64.
 * The per-channel tensors either share the input's dtype or, for F16/BF16 input, are
 * INFINI_DTYPE_F32. Accumulation is in at least single precision.
 *
 * Outputs: output = (input - mean) * invstd * weight + bias; saved_mean = mean, the batch
 * mean; saved_invstd = invstd = 1 / sqrt(var + eps), var the biased batch variance. These
 * two are what INFINIOP_BATCH_NORM_BACKWARD_MODE_SAVED_INVSTD of
 * infiniopBatchNormBackward() takes as its running_mean and running_var. When given,
 * running_mean and running_var are updated in place as PyTorch does:
 * running = (1 - momentum) * running + momentum * batch, with the unbiased batch variance
 * (var * n / (n - 1), n values per channel) for running_var.
 *
 * Empty batch (no values per channel: N = 0 or a spatial size 0), as PyTorch: nothing is
 * written (output is empty, running_mean and running_var stay as they are, saved_mean and
 * saved_invstd are left unwritten like PyTorch's uninitialized ones); data pointers may be
 * NULL.
 *
 * Call order: infiniopCreateBatchNormForwardTrainingDescriptor(),
 * infiniopSetBatchNormForwardTrainingAttributes() (optional),
 * infiniopGetBatchNormForwardTrainingWorkspaceSize() and
 * infiniopGetBatchNormForwardTrainingReserveSize(), infiniopBatchNormForwardTraining() any
 * number of times, infiniopDestroyBatchNormForwardTrainingDescriptor().
 */
#ifndef INFINIOP_OPS_BATCH_NORM_FORWARD_TRAINING_H
#define INFINIOP_OPS_BATCH_NORM_FORWARD_TRAINING_H

#include <stddef.h>

#include "../../infinicore.h"
#include "../handle.h"
#include "../tensor_descriptor.h"

#ifdef __cplusplus
extern "C" {
#endif

/** @brief Opaque training-mode batch-norm forward descriptor: validated arguments and cached
 *  sizes. */
typedef struct InfiniopBatchNormForwardTrainingDescriptor
    *infiniopBatchNormForwardTrainingDescriptor_t;

/**
 * @brief Validate the arguments of a training-mode batch-norm forward and create its
 * descriptor.
 *
 * Everything that can be checked without data is checked here. On INFINI_DEVICE_NVIDIA
 * the cuDNN tensor descriptors are built and the workspace and reserve sizes are queried
 * once. The tensor descriptors are not retained and may be destroyed after this call.
 *
 * @param handle            Handle of the device the computation runs on.
 * @param desc_ptr          Out: receives the new descriptor. Must not be NULL.
 * @param output_desc       Output y; same shape and dtype as input, must not overlap itself.
 * @param saved_mean_desc   Output: the batch mean, shape (C).
 * @param saved_invstd_desc Output: 1 / sqrt(biased batch variance + eps), shape (C).
 * @param input_desc        Input x, shape (N, C, ...).
 * @param weight_desc       Weight (gamma), shape (C).
 * @param bias_desc         Bias (beta), shape (C).
 * @param running_mean_desc Running mean, shape (C), updated in place. May be NULL: no
 *                          running mean is kept.
 * @param running_var_desc  Running variance, shape (C), updated in place. May be NULL as
 *                          running_mean_desc may.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if handle, desc_ptr or a tensor descriptor other than
 *         running_mean_desc and running_var_desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if handle or a tensor descriptor is unknown or destroyed;
 *         INFINI_STATUS_BAD_TENSOR_SHAPE if a rank or shape is not accepted, the shapes
 *         disagree, or input has only one value per channel;
 *         INFINI_STATUS_BAD_TENSOR_DTYPE if a dtype is not accepted or the dtypes disagree;
 *         INFINI_STATUS_BAD_TENSOR_STRIDES if a stride is negative, a per-channel stride is
 *         not positive, or output overlaps itself;
 *         INFINI_STATUS_DEVICE_TYPE_NOT_SUPPORTED if the handle's device is not served;
 *         INFINI_STATUS_DEVICE_NOT_INITIALIZED if cuDNN cannot be loaded or initialized;
 *         other codes mapped from a cuDNN failure (INFINI_STATUS_NOT_IMPLEMENTED,
 *         INFINI_STATUS_INTERNAL_ERROR, ...).
 */
infiniStatus_t infiniopCreateBatchNormForwardTrainingDescriptor(
    infiniopHandle_t handle,
    infiniopBatchNormForwardTrainingDescriptor_t *desc_ptr,
    infiniopTensorDescriptor_t output_desc,
    infiniopTensorDescriptor_t saved_mean_desc,
    infiniopTensorDescriptor_t saved_invstd_desc,
    infiniopTensorDescriptor_t input_desc,
    infiniopTensorDescriptor_t weight_desc,
    infiniopTensorDescriptor_t bias_desc,
    infiniopTensorDescriptor_t running_mean_desc,
    infiniopTensorDescriptor_t running_var_desc);

/**
 * @brief Set epsilon and the momentum. Optional: the defaults are eps 1e-5 and momentum 0.1
 * (PyTorch's).
 *
 * Call it before infiniopGetBatchNormForwardTrainingWorkspaceSize(),
 * infiniopGetBatchNormForwardTrainingReserveSize() and the first
 * infiniopBatchNormForwardTraining() on desc: the sizes may depend on the attributes.
 *
 * @param desc     Descriptor from infiniopCreateBatchNormForwardTrainingDescriptor().
 * @param eps      Added to the variance before the square root; finite and >= 0 (0 is
 *                 allowed).
 * @param momentum Weight of the batch statistics in the running update, in [0, 1]:
 *                 0 leaves the running statistics as they are, 1 replaces them.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed, eps is negative, NaN or
 *         infinite, or momentum is outside [0, 1] or NaN;
 *         other codes of infiniopCreateBatchNormForwardTrainingDescriptor() where preparing
 *         the computation for the new attributes fails (INFINI_STATUS_DEVICE_NOT_INITIALIZED,
 *         ...).
 */
infiniStatus_t infiniopSetBatchNormForwardTrainingAttributes(
    infiniopBatchNormForwardTrainingDescriptor_t desc,
    double eps,
    double momentum);

/**
 * @brief Size in bytes of the workspace infiniopBatchNormForwardTraining() needs.
 *
 * @param desc Descriptor from infiniopCreateBatchNormForwardTrainingDescriptor().
 * @param size Out: receives the size in bytes (may be 0). Must not be NULL.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc or size is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed.
 */
infiniStatus_t infiniopGetBatchNormForwardTrainingWorkspaceSize(
    infiniopBatchNormForwardTrainingDescriptor_t desc,
    size_t *size);

/**
 * @brief Size in bytes of the reserve space infiniopBatchNormForwardTraining() fills.
 *
 * The reserve space holds what cuDNN keeps from the forward pass for its backward pass.
 * It is 0 on INFINI_DEVICE_CPU and wherever cuDNN keeps nothing.
 *
 * @param desc Descriptor from infiniopCreateBatchNormForwardTrainingDescriptor().
 * @param size Out: receives the size in bytes (may be 0). Must not be NULL.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc or size is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed.
 */
infiniStatus_t infiniopGetBatchNormForwardTrainingReserveSize(
    infiniopBatchNormForwardTrainingDescriptor_t desc,
    size_t *size);

/**
 * @brief Compute output, saved_mean and saved_invstd, and update the running statistics.
 *
 * Data pointers are host addresses on INFINI_DEVICE_CPU and device addresses on
 * INFINI_DEVICE_NVIDIA, laid out as the descriptor's tensor descriptors say. The call
 * neither allocates nor synchronizes: on NVIDIA the work is queued on stream, so it can
 * be captured in a CUDA graph. The outputs must not alias the inputs; running_mean and
 * running_var are read and written.
 *
 * @param desc           Descriptor from infiniopCreateBatchNormForwardTrainingDescriptor().
 * @param workspace      Scratch memory on the descriptor's device, at least the size
 *                       infiniopGetBatchNormForwardTrainingWorkspaceSize() reported; may be
 *                       NULL when that size is 0.
 * @param workspace_size Size of workspace in bytes.
 * @param reserve        Output: reserve space on the descriptor's device, at least the size
 *                       infiniopGetBatchNormForwardTrainingReserveSize() reported; may be
 *                       NULL when that size is 0.
 * @param reserve_size   Size of reserve in bytes.
 * @param output         Output y.
 * @param saved_mean     Output: the batch mean.
 * @param saved_invstd   Output: 1 / sqrt(biased batch variance + eps).
 * @param input          Input x.
 * @param weight         Weight (gamma).
 * @param bias           Bias (beta).
 * @param running_mean   Running mean, updated in place; not read when desc was created
 *                       without running_mean_desc.
 * @param running_var    Running variance, updated in place; not read when desc was created
 *                       without running_var_desc.
 * @param stream         cudaStream_t to run on (NULL: the default stream) on
 *                       INFINI_DEVICE_NVIDIA; ignored on INFINI_DEVICE_CPU.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL, a data pointer the descriptor reads or
 *         writes is NULL, or workspace or reserve is NULL while its required size is not 0;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or destroyed, a data pointer is not
 *         aligned to its elements, or an output overlaps another argument other than
 *         in place (a data output exactly on a read data tensor of its layout, or on the
 *         CPU over one in any way); nothing is written;
 *         INFINI_STATUS_INSUFFICIENT_WORKSPACE if workspace_size or reserve_size is smaller
 *         than the reported size (nothing is written);
 *         INFINI_STATUS_BAD_TENSOR_DTYPE if cuDNN rejects a dtype;
 *         INFINI_STATUS_INTERNAL_ERROR, or another code mapped from a cuDNN failure.
 */
infiniStatus_t infiniopBatchNormForwardTraining(
    infiniopBatchNormForwardTrainingDescriptor_t desc,
    void *workspace,
    size_t workspace_size,
    void *reserve,
    size_t reserve_size,
    void *output,
    void *saved_mean,
    void *saved_invstd,
    const void *input,
    const void *weight,
    const void *bias,
    void *running_mean,
    void *running_var,
    void *stream);

/**
 * @brief Destroy a descriptor and release what it holds.
 *
 * @param desc Descriptor from infiniopCreateBatchNormForwardTrainingDescriptor(); invalid
 *             afterwards.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or already destroyed.
 */
infiniStatus_t infiniopDestroyBatchNormForwardTrainingDescriptor(
    infiniopBatchNormForwardTrainingDescriptor_t desc);

#ifdef __cplusplus
}
#endif

#endif /* INFINIOP_OPS_BATCH_NORM_FORWARD_TRAINING_H */
