/**
 * @file infiniop/tensor_descriptor.h
 * @brief Tensor descriptors: element type, shape and strides of an operator argument.
 */
#ifndef INFINIOP_TENSOR_DESCRIPTOR_H
#define INFINIOP_TENSOR_DESCRIPTOR_H

#include <stddef.h>

#include "../infinicore.h"

#ifdef __cplusplus
extern "C" {
#endif

/** @brief Opaque tensor descriptor. It describes memory; it owns none. */
typedef struct InfiniopTensorDescriptor *infiniopTensorDescriptor_t;

/**
 * @brief Create a descriptor of a tensor with ndim axes.
 *
 * The arrays are copied; the caller may free them when the call returns. Whether an
 * operator accepts the shape and strides is checked when its descriptor is created.
 *
 * @param desc_ptr Out: receives the new descriptor. Must not be NULL.
 * @param ndim     Number of axes; 0 describes a scalar.
 * @param shape    Array of ndim sizes. May be NULL only when ndim is 0.
 * @param strides  Array of ndim strides, counted in elements (not bytes), or NULL for a
 *                 contiguous row-major tensor.
 * @param dtype    Element type.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc_ptr is NULL, or shape is NULL and ndim > 0;
 *         INFINI_STATUS_BAD_TENSOR_DTYPE if dtype is INFINI_DTYPE_INVALID or not an
 *         infiniDtype_t value;
 *         INFINI_STATUS_BAD_TENSOR_SHAPE if ndim exceeds 64, a size is 2^63 or more, or the
 *         tensor holds more bytes than a ptrdiff_t counts;
 *         INFINI_STATUS_BAD_TENSOR_STRIDES if a stride reaches an element more than a
 *         ptrdiff_t's bytes away;
 *         INFINI_STATUS_BAD_PARAM if desc_ptr is not writable memory for a descriptor.
 */
infiniStatus_t infiniopCreateTensorDescriptor(infiniopTensorDescriptor_t *desc_ptr,
                                              size_t ndim,
                                              size_t const *shape,
                                              ptrdiff_t const *strides,
                                              infiniDtype_t dtype);

/**
 * @brief Destroy a tensor descriptor. Operator descriptors created from it keep what they
 * need, so it may be destroyed as soon as they are created.
 *
 * @param desc The descriptor to destroy; invalid afterwards.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if desc is NULL;
 *         INFINI_STATUS_BAD_PARAM if desc is unknown or already destroyed.
 */
infiniStatus_t infiniopDestroyTensorDescriptor(infiniopTensorDescriptor_t desc);

#ifdef __cplusplus
}
#endif

#endif /* INFINIOP_TENSOR_DESCRIPTOR_H */
