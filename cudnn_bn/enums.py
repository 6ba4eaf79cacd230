"""The C contract's enums: ``infiniStatus_t``, ``infiniDtype_t`` and ``infiniDevice_t``.

Values match ``include/infinicore.h``; ``tests/test_headers.py`` fails if they drift.
"""

import enum


class Status(enum.IntEnum):
    """``infiniStatus_t``: what every C-API call returns (there is no 9)."""

    SUCCESS = 0
    INTERNAL_ERROR = 1
    NOT_IMPLEMENTED = 2
    BAD_PARAM = 3
    NULL_POINTER = 4
    DEVICE_TYPE_NOT_SUPPORTED = 5
    DEVICE_NOT_FOUND = 6
    DEVICE_NOT_INITIALIZED = 7
    DEVICE_ARCHITECTURE_NOT_SUPPORTED = 8
    BAD_TENSOR_DTYPE = 10
    BAD_TENSOR_SHAPE = 11
    BAD_TENSOR_STRIDES = 12
    INSUFFICIENT_WORKSPACE = 13


class DataType(enum.IntEnum):
    """``infiniDtype_t``: element types a tensor descriptor can name."""

    INVALID = 0
    BYTE = 1
    BOOL = 2
    I8 = 3
    I16 = 4
    I32 = 5
    I64 = 6
    U8 = 7
    U16 = 8
    U32 = 9
    U64 = 10
    F8 = 11
    F16 = 12
    F32 = 13
    F64 = 14
    C16 = 15
    C32 = 16
    C64 = 17
    C128 = 18
    BF16 = 19


class Device(enum.IntEnum):
    """``infiniDevice_t``: InfiniCore's device list; only CPU and NVIDIA are served here."""

    CPU = 0
    NVIDIA = 1
    CAMBRICON = 2
    ASCEND = 3
    METAX = 4
    MOORE = 5
    ILUVATAR = 6
    KUNLUN = 7
    SUGON = 8
