"""The prototype table against the wheel's headers and the real library, and its type safety."""

import ctypes
from ctypes import POINTER, c_char_p, c_double, c_int, c_size_t, c_void_p

import pytest
from c_headers import cudnn_functions

from cudnn_bn import cudnn_info
from cudnn_bn._cudnn.library import cudnn
from cudnn_bn._cudnn.prototypes import (
    PROTOTYPES,
    cudnnActivationDescriptor_t,
    cudnnHandle_t,
    cudnnRuntimeTag_p,
    cudnnTensorDescriptor_t,
)

# C type (without const and pointers) -> the ctypes type an argument of that type must have.
C_TYPES = {
    "void": None,
    "int": c_int,
    "size_t": c_size_t,
    "double": c_double,
    "cudaStream_t": c_void_p,
    "cudnnHandle_t": cudnnHandle_t,
    "cudnnTensorDescriptor_t": cudnnTensorDescriptor_t,
    "cudnnActivationDescriptor_t": cudnnActivationDescriptor_t,
    "cudnnRuntimeTag_t": cudnnRuntimeTag_p._type_,  # a struct, passed by pointer
    **dict.fromkeys(  # C enums are passed as int
        [
            "cudnnStatus_t",
            "cudnnDataType_t",
            "cudnnBatchNormMode_t",
            "cudnnBatchNormOps_t",
            "cudnnActivationMode_t",
            "cudnnNanPropagation_t",
            "cudnnErrQueryMode_t",
        ],
        c_int,
    ),
}


def expected_ctype(c_type: str) -> type | None:
    """The ctypes type for a parsed C type such as ``const void *`` or ``int *``."""
    tokens = [t for t in c_type.split() if t != "const"]
    base, stars = " ".join(t for t in tokens if t != "*"), tokens.count("*")
    if stars == 1 and base in ("void", "char"):
        return c_void_p if base == "void" else c_char_p
    assert base in C_TYPES, f"add C type {base!r} to C_TYPES"
    assert stars <= 1, f"{c_type}: no double pointers in this table"
    return POINTER(C_TYPES[base]) if stars else C_TYPES[base]


@pytest.mark.parametrize("name", sorted(PROTOTYPES))
def test_entry_matches_header_declaration(name):
    declared = cudnn_functions().get(name)
    assert declared is not None, f"{name} is not declared in cudnn_graph.h or cudnn_ops.h"
    restype, argtypes = PROTOTYPES[name]
    assert len(argtypes) == len(declared.params)
    for index, (param, argtype) in enumerate(zip(declared.params, argtypes, strict=True)):
        expected = expected_ctype(param.type)
        assert argtype is expected, f"argument {index} ({param.type} {param.name})"
    assert restype is expected_ctype(declared.returns)


@pytest.mark.parametrize("name", sorted(PROTOTYPES))
def test_entry_is_exported_by_the_library(name):
    library = ctypes.CDLL(cudnn_info().path)
    assert hasattr(library, name), f"{name} is not exported by {cudnn_info().path}"


# (function, position, a value of the wrong type). The functions are never entered: ctypes
# rejects the argument first, and every other argument is a NULL of the right type.
WRONG_ARGUMENTS = [
    ("cudnnDestroyTensorDescriptor", 0, cudnnHandle_t()),
    ("cudnnDestroyTensorDescriptor", 0, cudnnActivationDescriptor_t()),
    ("cudnnDestroyTensorDescriptor", 0, 0x1000),
    ("cudnnDestroy", 0, cudnnTensorDescriptor_t()),
    ("cudnnDestroy", 0, 0x1000),
    ("cudnnDestroyActivationDescriptor", 0, cudnnTensorDescriptor_t()),
    ("cudnnDeriveBNTensorDescriptor", 1, cudnnHandle_t()),
    ("cudnnCreateTensorDescriptor", 0, ctypes.byref(cudnnHandle_t())),
]


@pytest.mark.parametrize(("name", "position", "wrong"), WRONG_ARGUMENTS)
def test_opaque_types_reject_each_other(name, position, wrong):
    _, argtypes = PROTOTYPES[name]
    args = [t() if t is not None else None for t in argtypes]
    args[position] = wrong
    with pytest.raises(ctypes.ArgumentError, match=f"argument {position + 1}:"):
        getattr(cudnn(), name)(*args)
