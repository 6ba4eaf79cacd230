/**
 * @file infinicore.h
 * @brief Types shared by every InfiniCore-style API: status codes, element types, devices.
 *
 * The numeric values are InfiniCore's and are part of the ABI. The Python package
 * mirrors them in `cudnn_bn.enums` (`Status`, `DataType`, `Device`);
 * `tests/test_headers.py` fails if the two drift apart.
 */
#ifndef INFINICORE_H
#define INFINICORE_H

#ifdef __cplusplus
extern "C" {
#endif

/**
 * @brief What every API call returns. Zero is success; there is no value 9.
 */
typedef enum {
    /** The call did what it was asked. */
    INFINI_STATUS_SUCCESS = 0,
    /** A failure inside the library or the vendor library that no other code describes. */
    INFINI_STATUS_INTERNAL_ERROR = 1,
    /** The operation, or this combination of arguments, is not implemented. */
    INFINI_STATUS_NOT_IMPLEMENTED = 2,
    /** An argument has an invalid value: an unknown or destroyed handle or descriptor,
     *  an out-of-range number. */
    INFINI_STATUS_BAD_PARAM = 3,
    /** A pointer argument that must not be NULL is NULL. */
    INFINI_STATUS_NULL_POINTER = 4,
    /** The device type is not served by this library. */
    INFINI_STATUS_DEVICE_TYPE_NOT_SUPPORTED = 5,
    /** No device with the requested index exists. */
    INFINI_STATUS_DEVICE_NOT_FOUND = 6,
    /** The device or its runtime (driver, vendor library) could not be initialized. */
    INFINI_STATUS_DEVICE_NOT_INITIALIZED = 7,
    /** The device's architecture is not supported by the vendor library. */
    INFINI_STATUS_DEVICE_ARCHITECTURE_NOT_SUPPORTED = 8,
    /** A tensor's element type is not accepted by the operation. */
    INFINI_STATUS_BAD_TENSOR_DTYPE = 10,
    /** A tensor's shape is not accepted, or shapes do not agree with each other. */
    INFINI_STATUS_BAD_TENSOR_SHAPE = 11,
    /** A tensor's strides (memory layout) are not accepted. */
    INFINI_STATUS_BAD_TENSOR_STRIDES = 12,
    /** The workspace passed is smaller than the size the descriptor reported. */
    INFINI_STATUS_INSUFFICIENT_WORKSPACE = 13
} infiniStatus_t;

/**
 * @brief Element type of a tensor.
 */
typedef enum {
    INFINI_DTYPE_INVALID = 0, /**< No type; never valid in a tensor descriptor. */
    INFINI_DTYPE_BYTE = 1,    /**< Raw byte. */
    INFINI_DTYPE_BOOL = 2,    /**< Boolean, one byte. */
    INFINI_DTYPE_I8 = 3,      /**< Signed 8-bit integer. */
    INFINI_DTYPE_I16 = 4,     /**< Signed 16-bit integer. */
    INFINI_DTYPE_I32 = 5,     /**< Signed 32-bit integer. */
    INFINI_DTYPE_I64 = 6,     /**< Signed 64-bit integer. */
    INFINI_DTYPE_U8 = 7,      /**< Unsigned 8-bit integer. */
    INFINI_DTYPE_U16 = 8,     /**< Unsigned 16-bit integer. */
    INFINI_DTYPE_U32 = 9,     /**< Unsigned 32-bit integer. */
    INFINI_DTYPE_U64 = 10,    /**< Unsigned 64-bit integer. */
    INFINI_DTYPE_F8 = 11,     /**< 8-bit floating point. */
    INFINI_DTYPE_F16 = 12,    /**< IEEE 754 binary16 (half). */
    INFINI_DTYPE_F32 = 13,    /**< IEEE 754 binary32 (float). */
    INFINI_DTYPE_F64 = 14,    /**< IEEE 754 binary64 (double). */
    INFINI_DTYPE_C16 = 15,    /**< Complex of two 8-bit floats. */
    INFINI_DTYPE_C32 = 16,    /**< Complex of two binary16. */
    INFINI_DTYPE_C64 = 17,    /**< Complex of two binary32. */
    INFINI_DTYPE_C128 = 18,   /**< Complex of two binary64. */
    INFINI_DTYPE_BF16 = 19    /**< bfloat16 (8-bit exponent, 7-bit mantissa). */
} infiniDtype_t;

/**
 * @brief Device type. This library serves INFINI_DEVICE_CPU and INFINI_DEVICE_NVIDIA;
 * any other value gives INFINI_STATUS_DEVICE_TYPE_NOT_SUPPORTED.
 */
typedef enum {
    INFINI_DEVICE_CPU = 0,       /**< Host CPU; data pointers are host addresses. */
    INFINI_DEVICE_NVIDIA = 1,    /**< NVIDIA GPU through CUDA and cuDNN; device addresses. */
    INFINI_DEVICE_CAMBRICON = 2, /**< Cambricon MLU (not served here). */
    INFINI_DEVICE_ASCEND = 3,    /**< Huawei Ascend NPU (not served here). */
    INFINI_DEVICE_METAX = 4,     /**< MetaX GPU (not served here). */
    INFINI_DEVICE_MOORE = 5,     /**< Moore Threads GPU (not served here). */
    INFINI_DEVICE_ILUVATAR = 6,  /**< Iluvatar CoreX GPU (not served here). */
    INFINI_DEVICE_KUNLUN = 7,    /**< Kunlun XPU (not served here). */
    INFINI_DEVICE_SUGON = 8      /**< Sugon DCU (not served here). */
} infiniDevice_t;

#ifdef __cplusplus
}
#endif

#endif /* INFINICORE_H */
