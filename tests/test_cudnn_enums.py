"""``cudnn_bn._cudnn.enums`` against the enums of the wheel's ``cudnn_graph.h``/``cudnn_ops.h``."""

import pytest
from c_headers import cudnn_enums

from cudnn_bn._cudnn.enums import (
    ActivationMode,
    BatchNormMode,
    BatchNormOps,
    CudnnDataType,
    CudnnStatus,
    ErrQueryMode,
    NanPropagation,
)

ENUMS = {  # Python enum -> (C typedef, prefix its member names drop)
    CudnnStatus: ("cudnnStatus_t", "CUDNN_STATUS_"),
    CudnnDataType: ("cudnnDataType_t", "CUDNN_DATA_"),
    BatchNormMode: ("cudnnBatchNormMode_t", "CUDNN_BATCHNORM_"),
    BatchNormOps: ("cudnnBatchNormOps_t", "CUDNN_BATCHNORM_OPS_"),
    ActivationMode: ("cudnnActivationMode_t", "CUDNN_ACTIVATION_"),
    NanPropagation: ("cudnnNanPropagation_t", "CUDNN_"),
    ErrQueryMode: ("cudnnErrQueryMode_t", "CUDNN_ERRQUERY_"),
}
MEMBERS = [member for enum in ENUMS for member in enum]


@pytest.mark.parametrize("member", MEMBERS, ids=lambda m: f"{type(m).__name__}.{m.name}")
def test_member_has_the_header_value(member):
    typedef, prefix = ENUMS[type(member)]
    in_header = cudnn_enums()[typedef]
    name = prefix + member.name
    assert name in in_header, f"{name} is not in {typedef}"
    assert in_header[name].value == member.value


def test_every_current_status_of_the_header_is_known():
    current = {
        name.removeprefix("CUDNN_STATUS_"): member.value
        for name, member in cudnn_enums()["cudnnStatus_t"].items()
        if not member.deprecated
    }
    assert len(current) > 40  # the header parsed
    missing = {n: v for n, v in current.items() if CudnnStatus.__members__.get(n) != v}
    assert missing == {}, "CudnnStatus lacks these cudnnStatus_t values"
