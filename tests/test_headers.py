"""The C headers in ``include/`` against Python: enums, the spec's signatures, ``cudnn_bn.capi``.

The headers are the single source of truth for names, argument order and values; these
tests fail as soon as the Python side (or the header) drifts. The compiler tests check that
the headers are valid C99 and C++, self-contained, and give C linkage under C++.
"""

import importlib
import inspect
import shutil
import subprocess

import pytest
from c_headers import INCLUDE, infini_enums, infini_functions, infini_headers
from helpers import BACKWARD_ORDER, INFERENCE_ORDER, TRAINING_ORDER

from cudnn_bn.enums import DataType, Device, Status
from cudnn_bn.problems import Mode

ENUMS = [  # (C typedef, member prefix, Python enum)
    ("infiniStatus_t", "INFINI_STATUS_", Status),
    ("infiniDtype_t", "INFINI_DTYPE_", DataType),
    ("infiniDevice_t", "INFINI_DEVICE_", Device),
    ("infiniopBatchNormBackwardMode_t", "INFINIOP_BATCH_NORM_BACKWARD_MODE_", Mode),
]


# The C API, InfiniCore's batch-norm backward operator and the forward passes: name -> parameter
# names, in order.
def _operator(name: str, order: tuple[str, ...], attributes: list[str], sizes: list[str]) -> dict:
    """An operator's five (or six) functions: create, set attributes, size queries, compute
    (buffers first, then the tensors in ``order``, then the stream), destroy."""
    buffers = [p for size in sizes for p in (size.lower(), f"{size.lower()}_size")]
    return {
        f"infiniopCreate{name}Descriptor": ["handle", "desc_ptr", *(f"{n}_desc" for n in order)],
        f"infiniopSet{name}Attributes": ["desc", *attributes],
        **{f"infiniopGet{name}{size}Size": ["desc", "size"] for size in sizes},
        f"infiniop{name}": ["desc", *buffers, *order, "stream"],
        f"infiniopDestroy{name}Descriptor": ["desc"],
    }


# The C API, InfiniCore's batch-norm backward operator and the forward passes: name -> parameter
# names, in order (the tensors in the spec's orders, ``helpers``' *_ORDER).
SPEC_SIGNATURES = {
    "infinirtSetDevice": ["device", "device_id"],
    "infiniopCreateHandle": ["handle_ptr"],
    "infiniopDestroyHandle": ["handle"],
    "infiniopCreateTensorDescriptor": ["desc_ptr", "ndim", "shape", "strides", "dtype"],
    "infiniopDestroyTensorDescriptor": ["desc"],
    **_operator("BatchNormBackward", BACKWARD_ORDER, ["eps", "mode"], ["Workspace"]),
    **_operator(
        "BatchNormForwardTraining", TRAINING_ORDER, ["eps", "momentum"], ["Workspace", "Reserve"]
    ),
    **_operator("BatchNormForwardInference", INFERENCE_ORDER, ["eps"], ["Workspace"]),
}

# The headers of the C contract, relative to include/.
HEADERS = {
    "infinicore.h",
    "infinirt.h",
    "infiniop/handle.h",
    "infiniop/tensor_descriptor.h",
    "infiniop/ops/batch_norm_backward.h",
    "infiniop/ops/batch_norm_forward_training.h",
    "infiniop/ops/batch_norm_forward_inference.h",
}


def test_the_contract_headers_are_all_there():
    assert {h.relative_to(INCLUDE).as_posix() for h in infini_headers()} == HEADERS


@pytest.mark.parametrize(("typedef", "prefix", "enum"), ENUMS, ids=[e[0] for e in ENUMS])
def test_enum_matches_python(typedef, prefix, enum):
    in_header = {name: member.value for name, member in infini_enums()[typedef].items()}
    assert in_header == {prefix + member.name: member.value for member in enum}


def test_headers_declare_the_spec_signatures():
    declared = {f.name: [p.name for p in f.params] for f in infini_functions().values()}
    assert declared == SPEC_SIGNATURES


def test_every_function_returns_a_status():
    assert {f.returns for f in infini_functions().values()} == {"infiniStatus_t"}


@pytest.mark.parametrize("name", sorted(infini_functions()))
def test_capi_function_matches_header(name):
    capi = importlib.import_module("cudnn_bn.capi")
    function = getattr(capi, name, None)
    assert callable(function), f"cudnn_bn.capi has no function {name}"
    header_params = [p.name for p in infini_functions()[name].params]
    assert list(inspect.signature(function).parameters) == header_params


def test_capi_has_no_function_missing_from_the_headers():
    capi = importlib.import_module("cudnn_bn.capi")
    public = {n for n, v in vars(capi).items() if n.startswith("infini") and callable(v)}
    assert public - set(infini_functions()) == set()


# --- the headers compile --------------------------------------------------------------------

COMPILERS = {  # language -> (compiler, flags)
    "c99": ("gcc", ["-x", "c", "-std=c99"]),
    "c++11": ("g++", ["-x", "c++", "-std=c++11"]),
}
STRICT = ["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-pedantic"]


def _compiler(language: str) -> list[str]:
    compiler, flags = COMPILERS[language]
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed")
    return [compiler, *flags, "-I", str(INCLUDE)]


def _compile(command: list[str], source: str) -> None:
    result = subprocess.run(command, input=source, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}\n{source}"


def _include(header) -> str:
    return f'#include "{header.relative_to(INCLUDE).as_posix()}"\n'


@pytest.mark.parametrize("language", COMPILERS)
@pytest.mark.parametrize("header", infini_headers(), ids=lambda h: str(h.relative_to(INCLUDE)))
def test_header_compiles_on_its_own(language, header):
    _compile([*_compiler(language), *STRICT, "-"], _include(header))


@pytest.mark.parametrize("language", COMPILERS)
def test_headers_compile_together_twice_with_the_parsed_values(language):
    """Include guards hold, and the compiler agrees with the values the parser read."""
    includes = "".join(_include(h) for h in infini_headers())
    checks = "".join(
        f"typedef char check_{name}[({name}) == {member.value} ? 1 : -1];\n"
        for members in infini_enums().values()
        for name, member in members.items()
    )
    _compile([*_compiler(language), *STRICT, "-"], includes + includes + checks)


def test_functions_have_c_linkage_in_cxx(tmp_path):
    """Under C++ every declared function must reference an unmangled symbol."""
    if shutil.which("nm") is None:
        pytest.skip("nm is not installed")
    names = sorted(infini_functions())
    source = (
        "".join(_include(h) for h in infini_headers())
        + "typedef void (*any_function)(void);\n"
        + "any_function references[] = {\n"
        + "".join(f"    reinterpret_cast<any_function>(&{name}),\n" for name in names)
        + "};\n"
    )
    obj = tmp_path / "references.o"
    _compile([*_compiler("c++11"), "-c", "-o", str(obj), "-"], source)
    nm = subprocess.run(["nm", "--undefined-only", str(obj)], capture_output=True, text=True)
    undefined = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert set(names) <= undefined, nm.stdout


def test_capi_prototypes_are_the_headers():
    """``capi.PROTOTYPES``, which converts every argument, is the headers' declarations:
    names and C types in order."""
    capi = importlib.import_module("cudnn_bn.capi")
    declared = {
        f.name: tuple((p.name, p.type) for p in f.params) for f in infini_functions().values()
    }
    assert declared == capi.PROTOTYPES
