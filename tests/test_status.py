"""cuDNN status codes to ``Status`` (``cudnn_bn/_cudnn/status.py``), ``InfiniError`` by status."""

import pickle

import pytest
from c_headers import cudnn_enums

from cudnn_bn import InfiniError, Status, cudnn_status_to_infini
from cudnn_bn.errors import CudnnNotFoundError, DeviceNotInitializedError

S = Status

# The mapping, row by row (cuDNN 9 codes).
CUDNN9 = {
    0: S.SUCCESS,
    1001: S.DEVICE_NOT_INITIALIZED,  # NOT_INITIALIZED
    **dict.fromkeys([1002, 1003, 1004, 1005, 1006, 1007, 1008, 1999], S.INTERNAL_ERROR),
    **dict.fromkeys([2000, 2001, 2004, 2005, 2007, 2009, 2010, 2011, 2012, 2999], S.BAD_PARAM),
    2002: S.NULL_POINTER,  # BAD_PARAM_NULL_POINTER
    2003: S.BAD_TENSOR_STRIDES,  # BAD_PARAM_MISALIGNED_POINTER
    2006: S.INSUFFICIENT_WORKSPACE,  # BAD_PARAM_SIZE_INSUFFICIENT
    2008: S.BAD_TENSOR_SHAPE,  # BAD_PARAM_SHAPE_MISMATCH
    **dict.fromkeys([3000, 3001, 3008, 3009, 3010, 3012, 3013, 3014, 3999], S.NOT_IMPLEMENTED),
    3002: S.BAD_TENSOR_SHAPE,  # NOT_SUPPORTED_SHAPE
    3003: S.BAD_TENSOR_DTYPE,  # NOT_SUPPORTED_DATA_TYPE
    3004: S.BAD_TENSOR_STRIDES,  # NOT_SUPPORTED_LAYOUT
    3011: S.BAD_TENSOR_STRIDES,  # NOT_SUPPORTED_PADDING
    3005: S.DEVICE_NOT_INITIALIZED,  # NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER
    3006: S.DEVICE_NOT_INITIALIZED,  # NOT_SUPPORTED_INCOMPATIBLE_CUDART
    3007: S.DEVICE_ARCHITECTURE_NOT_SUPPORTED,  # NOT_SUPPORTED_ARCH_MISMATCH
    **dict.fromkeys(range(4000, 4007), S.INTERNAL_ERROR),
    **dict.fromkeys(range(5000, 5005), S.INTERNAL_ERROR),
}

# cuDNN 8 codes, mapped as their cuDNN 9 counterparts are.
CUDNN8 = {
    0: S.SUCCESS,
    1: S.DEVICE_NOT_INITIALIZED,  # NOT_INITIALIZED
    2: S.INTERNAL_ERROR,  # ALLOC_FAILED (9: INTERNAL_ERROR_HOST_ALLOCATION_FAILED)
    3: S.BAD_PARAM,  # BAD_PARAM
    4: S.INTERNAL_ERROR,  # INTERNAL_ERROR
    5: S.BAD_PARAM,  # INVALID_VALUE
    6: S.DEVICE_ARCHITECTURE_NOT_SUPPORTED,  # ARCH_MISMATCH
    7: S.INTERNAL_ERROR,  # MAPPING_ERROR
    8: S.INTERNAL_ERROR,  # EXECUTION_FAILED
    9: S.NOT_IMPLEMENTED,  # NOT_SUPPORTED
    10: S.INTERNAL_ERROR,  # LICENSE_ERROR
    11: S.NOT_IMPLEMENTED,  # RUNTIME_PREREQUISITE_MISSING (9: NOT_SUPPORTED_...)
    12: S.INTERNAL_ERROR,  # RUNTIME_IN_PROGRESS
    13: S.INTERNAL_ERROR,  # RUNTIME_FP_OVERFLOW
    14: S.INTERNAL_ERROR,  # VERSION_MISMATCH
}

UNKNOWN = [-1, -1001, 15, 999, 6000, 9999, 2**31 - 1, -(2**31)]


@pytest.mark.parametrize(("code", "status"), CUDNN9.items())
def test_cudnn9_code(code, status):
    assert cudnn_status_to_infini(code) is status


@pytest.mark.parametrize(("code", "status"), CUDNN8.items())
def test_cudnn8_code(code, status):
    assert cudnn_status_to_infini(code) is status


@pytest.mark.parametrize("code", UNKNOWN)
def test_unknown_code_is_internal_error(code):
    assert cudnn_status_to_infini(code) is S.INTERNAL_ERROR


def test_every_header_failure_is_a_failure():
    codes = cudnn_enums()["cudnnStatus_t"]
    failures = {name: m.value for name, m in codes.items() if name != "CUDNN_STATUS_SUCCESS"}
    assert failures
    mapped = {name: cudnn_status_to_infini(code) for name, code in failures.items()}
    assert [name for name, status in mapped.items() if status is S.SUCCESS] == []


def test_every_header_code_is_in_the_table_above():
    """So a new cuDNN code gets a deliberate row here, not just its category's default."""
    values = {m.value for m in cudnn_enums()["cudnnStatus_t"].values()}
    assert values - CUDNN9.keys() == set()


def test_cudnn8_names_map_like_their_cudnn9_aliases():
    """cuDNN 9's header keeps cuDNN 8 names as deprecated aliases of the new codes."""
    header = cudnn_enums()["cudnnStatus_t"]
    codes = {name.removeprefix("CUDNN_STATUS_"): m.value for name, m in header.items()}
    cudnn8_names = [
        "NOT_INITIALIZED",
        "ALLOC_FAILED",
        "BAD_PARAM",
        "INTERNAL_ERROR",
        "INVALID_VALUE",
        "ARCH_MISMATCH",
        "MAPPING_ERROR",
        "EXECUTION_FAILED",
        "NOT_SUPPORTED",
        "LICENSE_ERROR",
        "RUNTIME_PREREQUISITE_MISSING",
        "RUNTIME_IN_PROGRESS",
        "RUNTIME_FP_OVERFLOW",
        "VERSION_MISMATCH",
    ]
    for code8, name in enumerate(cudnn8_names, start=1):
        assert cudnn_status_to_infini(code8) is cudnn_status_to_infini(codes[name]), name


FAILURES = [s for s in Status if s is not S.SUCCESS]


@pytest.mark.parametrize("status", FAILURES, ids=lambda s: s.name)
def test_error_for_status_is_its_subclass(status):
    error = InfiniError(status, "weight_desc: shape (4,) but input has 3 channels")
    assert type(error) is not InfiniError
    assert isinstance(error, InfiniError)
    assert type(error).status is status
    assert error.status is status
    assert str(error) == f"{status.name}: weight_desc: shape (4,) but input has 3 channels"
    with pytest.raises(type(error)):
        raise error


@pytest.mark.parametrize("status", FAILURES, ids=lambda s: s.name)
def test_error_subclasses_are_distinct(status):
    others = [s for s in FAILURES if s is not status]
    assert not any(isinstance(InfiniError(status), type(InfiniError(o))) for o in others)


@pytest.mark.parametrize("message", ["", "x", "a: b: c"])
@pytest.mark.parametrize("status", FAILURES, ids=lambda s: s.name)
def test_error_pickles(status, message):
    error = InfiniError(status, message)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.status is status
    assert str(copy) == str(error)


def test_cudnn_not_found_error_pickles_as_itself():
    error = CudnnNotFoundError(S.DEVICE_NOT_INITIALIZED, "libcudnn could not be loaded")
    assert isinstance(error, DeviceNotInitializedError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is CudnnNotFoundError
    assert str(copy) == str(error)
