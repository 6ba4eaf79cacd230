/**
 * @file infiniop/handle.h
 * @brief Operator-library handles: one per device, needed to create operator descriptors.
 */
#ifndef INFINIOP_HANDLE_H
#define INFINIOP_HANDLE_H

#include "../infinicore.h"

#ifdef __cplusplus
extern "C" {
#endif

/** @brief Opaque handle bound to one device (type and index). */
typedef struct InfiniopHandle *infiniopHandle_t;

/**
 * @brief Create a handle for the calling thread's current device (see infinirtSetDevice()).
 *
 * The device was checked when it was made current; cuDNN is loaded when the first
 * operator descriptor for an INFINI_DEVICE_NVIDIA handle needs it.
 *
 * @param handle_ptr Out: receives the new handle. Must not be NULL.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if handle_ptr is NULL;
 *         the status of the calling thread's last infinirtSetDevice() if that call failed
 *         (no handle is created for the device that was current before it).
 */
infiniStatus_t infiniopCreateHandle(infiniopHandle_t *handle_ptr);

/**
 * @brief Destroy a handle.
 *
 * @param handle The handle to destroy, from infiniopCreateHandle(); invalid afterwards.
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_NULL_POINTER if handle is NULL;
 *         INFINI_STATUS_BAD_PARAM if handle is unknown or already destroyed.
 */
infiniStatus_t infiniopDestroyHandle(infiniopHandle_t handle);

#ifdef __cplusplus
}
#endif

#endif /* INFINIOP_HANDLE_H */
