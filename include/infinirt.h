/**
 * @file infinirt.h
 * @brief Runtime: choosing the device that later calls work on.
 */
#ifndef INFINIRT_H
#define INFINIRT_H

#include "infinicore.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * @brief Make (device, device_id) the current device of the calling thread.
 *
 * infiniopCreateHandle() creates its handle for the current device. Until this is
 * called, the current device is INFINI_DEVICE_CPU, index 0. On INFINI_DEVICE_NVIDIA this
 * also makes CUDA device device_id current in the calling thread.
 *
 * @param device    The device type; INFINI_DEVICE_CPU or INFINI_DEVICE_NVIDIA.
 * @param device_id Index of the device among those of its type, from 0 (always 0 on the CPU).
 * @return INFINI_STATUS_SUCCESS;
 *         INFINI_STATUS_DEVICE_TYPE_NOT_SUPPORTED if device is neither CPU nor NVIDIA;
 *         INFINI_STATUS_DEVICE_NOT_FOUND if no device of that type has index device_id;
 *         INFINI_STATUS_DEVICE_NOT_INITIALIZED if the CUDA driver or runtime is missing
 *         or fails to initialize.
 */
infiniStatus_t infinirtSetDevice(infiniDevice_t device, int device_id);

#ifdef __cplusplus
}
#endif

#endif /* INFINIRT_H */
