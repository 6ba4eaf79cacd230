"""The exact arguments the NVIDIA backend hands cuDNN's batch-norm forward passes, checked
without a GPU: ``cudnnBatchNormalizationForwardTrainingEx`` (plain and fused, with its
workspace and reserve queries) and ``cudnnBatchNormalizationForwardInference``, through the
operator layer and the C API, on the stub libcudnn of ``cudnn_stub.py``.
"""

import ctypes
import gc
from ctypes import c_size_t, c_void_p

import pytest
from cudnn_stub import (
    ACTIVATION_RELU,
    CUDNN_HALF,
    CUDNN_TYPE,
    F16,
    F32,
    FAST_DTYPES,
    FUSED_ENGINES,
    FUSED_SHAPES,
    FUSIONS,
    OPS_BN,
    PERSISTENT_CASES,
    POINTERS,
    PROPAGATE_NAN,
    SPATIAL,
    SPATIAL_PERSISTENT,
    STREAM,
    STUB_RESERVE,
    STUB_WORKSPACE,
    WORKSPACE,
    assert_derived_bn_desc,
    capi_tensor,
    cudnn_strides,
    expected_bn_mode,
    fast_cases,
    fields,
    fused_engine,
    in_workspace,
    layout_strides,
    nothing_recorded,
    only,
    padded,
    pointers,
)
from helpers import INFERENCE_ORDER, TRAINING_ORDER, channels_last

import cudnn_bn
from cudnn_bn import (
    BatchNormForwardInferenceDescriptor,
    BatchNormForwardTrainingDescriptor,
    Device,
    Status,
    TensorDesc,
    capi,
)
from cudnn_bn.errors import (
    BadParamError,
    BadTensorDtypeError,
    InsufficientWorkspaceError,
    NullPointerError,
)
from cudnn_bn.tensor import contiguous_strides

# --- problems on fake device pointers ------------------------------------------------------

RESERVE = POINTERS["reserve"]
MOMENTUM = 0.25


def operands(shape, dtype, channel_dtype, strides):
    """The input's descriptor (shared by output and z) and a per-channel one."""
    x = TensorDesc(dtype, shape, strides or contiguous_strides(shape))
    return x, TensorDesc.contiguous(channel_dtype or dtype, (shape[1],))


def training(
    shape, dtype=F32, channel_dtype=None, *, strides=None, running="both", fusion=None, **attrs
):
    """A training-forward descriptor; ``running`` names the running statistics it keeps
    ("both", "mean", "var" or "none"); a BN+Add+ReLU one also gets a z descriptor.
    ``attrs``: eps, momentum, persistent."""
    x, channel = operands(shape, dtype, channel_dtype, strides)
    mean = channel if running in ("both", "mean") else None
    var = channel if running in ("both", "var") else None
    if fusion is not None:
        attrs["fusion"] = fusion
        if fusion == "add_relu":
            attrs["z_desc"] = x
    handle = cudnn_bn.Handle(Device.NVIDIA, 0)
    return BatchNormForwardTrainingDescriptor(
        handle, x, channel, channel, x, channel, channel, mean, var, **attrs
    )


def train(desc, *, reserve_size=None, workspace=WORKSPACE, stream=STREAM, **overrides):
    """``desc.compute`` on the fake pointers (``z`` passed only when given)."""
    ptrs = {**POINTERS, **overrides}
    size = desc.reserve_size if reserve_size is None else reserve_size
    z = {"z": ptrs["z"]} if "z" in overrides else {}
    args = (workspace, desc.workspace_size, ptrs["reserve"], size)
    desc.compute(*args, *(ptrs[name] for name in TRAINING_ORDER), stream=stream, **z)


def inference(shape, dtype=F32, channel_dtype=None, *, strides=None, eps=1e-5):
    x, channel = operands(shape, dtype, channel_dtype, strides)
    handle = cudnn_bn.Handle(Device.NVIDIA, 0)
    return BatchNormForwardInferenceDescriptor(
        handle, x, x, channel, channel, channel, channel, eps=eps
    )


def infer(desc, *, workspace=0, stream=STREAM):
    ptrs = (POINTERS[name] for name in INFERENCE_ORDER)
    desc.compute(workspace, desc.workspace_size, *ptrs, stream=stream)


def assert_outputs_buffers_and_queries(stub) -> None:
    """The training call got the saved statistics' pointers, the workspace and the reserve,
    and the size queries were asked for the very descriptors, mode and ops of the call."""
    call = stub.forward_training
    assert fields(call, "save_mean save_inv_variance") == pointers("saved_mean saved_invstd")
    assert (call.workspace, call.workspace_size) == (WORKSPACE, STUB_WORKSPACE)
    assert (call.reserve, call.reserve_size) == (RESERVE, STUB_RESERVE)
    same = "handle mode bn_ops x_desc z_desc y_desc bn_desc activation_desc"
    assert fields(stub.forward_query, same) == fields(call, same)
    same = "handle mode bn_ops activation_desc x_desc"
    assert fields(stub.reserve_query, same) == fields(call, same)


# --- training forward: every argument -------------------------------------------------------


@pytest.mark.parametrize(("shape", "dtype", "channel_dtype", "layout"), list(fast_cases()))
def test_training_fast_path_arguments(stub, shape, dtype, channel_dtype, layout):
    strides = layout_strides(shape, layout)
    with training(
        shape, dtype, channel_dtype, strides=strides, eps=1e-3, momentum=MOMENTUM
    ) as desc:
        assert desc.engine == "cudnn"
        assert (desc.workspace_size, desc.reserve_size) == (STUB_WORKSPACE, STUB_RESERVE)
        train(desc)
        call = stub.forward_training
        assert stub.calls() == only(
            "set_stream", "forward_query", "reserve_query", "forward_training"
        )
        assert call.handle != 0
        assert fields(stub.set_stream, "handle stream") == (call.handle, STREAM)

        bn_mode = expected_bn_mode(shape, layout)
        assert (call.mode, call.bn_ops) == (bn_mode, OPS_BN)
        assert (call.alpha, call.beta) == (1, 0)  # read as double for F64, float otherwise

        expected = (CUDNN_TYPE[dtype], padded(shape), cudnn_strides(shape, layout))
        for name in ("x_desc", "y_desc"):
            assert stub.tensor(getattr(call, name)) == expected, name
        assert (call.z_desc, call.z) == (0, 0)
        assert_derived_bn_desc(call.bn_desc, call.x_desc, bn_mode, shape, dtype)

        assert fields(call, "x y scale bias") == pointers("input output weight bias")
        assert call.exponential_average_factor == MOMENTUM
        assert fields(call, "running_mean running_var") == pointers("running_mean running_var")
        assert call.epsilon == 1e-3
        assert call.activation_desc == 0
        assert_outputs_buffers_and_queries(stub)


@pytest.mark.parametrize(("shape", "layout", "persistent", "mode"), PERSISTENT_CASES.values(),
                         ids=list(PERSISTENT_CASES))  # fmt: skip
def test_persistent_attribute_picks_the_mode(stub, shape, layout, persistent, mode):
    strides = layout_strides(shape, layout)
    with training(shape, F16, F32, strides=strides, persistent=persistent) as desc:
        assert desc.engine == "cudnn"
        train(desc)
        call = stub.forward_training
        assert (call.mode, stub.forward_query.mode, stub.reserve_query.mode) == (mode,) * 3
        assert_derived_bn_desc(call.bn_desc, call.x_desc, mode, shape, F16)


def test_sizes_are_what_cudnn_answers(stub):
    stub.workspace_bytes.value, stub.reserve_bytes.value = 5000, 777
    with training((2, 3, 4, 5)) as desc:
        assert (desc.workspace_size, desc.reserve_size) == (5000, 777)
        train(desc)
    assert fields(stub.forward_training, "workspace_size reserve_size") == (5000, 777)


@pytest.mark.parametrize("caller", [0, "pointers"])
def test_without_running_statistics_cudnn_gets_nulls(stub, caller):
    """No running descriptors: NULL running pointers whatever the caller passes (cuDNN would
    write through them, the CuPy engine ignores them)."""
    with training((2, 3, 4, 5), running="none") as desc:
        assert desc.workspace_size == STUB_WORKSPACE
        given = {} if caller == "pointers" else {"running_mean": 0, "running_var": 0}
        train(desc, **given)
    assert fields(stub.forward_training, "running_mean running_var") == (0, 0)


@pytest.mark.parametrize("kept", ["mean", "var"])
def test_one_running_statistic_gets_a_scratch_partner(stub, kept):
    """cuDNN updates both running statistics or neither: the one not kept is a workspace
    slice after cuDNN's own scratch, never the caller's pointer."""
    channels = 3
    with training((2, channels, 4, 5), running=kept) as desc:
        assert desc.workspace_size > STUB_WORKSPACE
        train(desc, **{f"running_{'var' if kept == 'mean' else 'mean'}": 0})
        call = stub.forward_training
        given = {"mean": call.running_mean, "var": call.running_var}
        missing = "var" if kept == "mean" else "mean"
        assert given[kept] == POINTERS[f"running_{kept}"]
        assert in_workspace(given[missing], 4 * channels, desc.workspace_size)


def test_small_null_or_misaligned_reserve_is_refused_before_cudnn(stub):
    """A misaligned reserve reached cuDNN before (the stub refused it, rule reserve-aligned)."""
    with training((2, 3, 4, 5)) as desc:
        with pytest.raises(InsufficientWorkspaceError, match="reserve_size") as caught:
            train(desc, reserve_size=STUB_RESERVE - 1)
        assert caught.value.status == Status.INSUFFICIENT_WORKSPACE
        with pytest.raises(NullPointerError, match="reserve") as caught:
            train(desc, reserve=0)
        assert caught.value.status == Status.NULL_POINTER
        for offset in (1, 8):
            with pytest.raises(BadParamError, match=r"reserve 0x[0-9a-f]+ is not 16-byte aligned"):
                train(desc, reserve=RESERVE + offset)
        with pytest.raises(NullPointerError, match="saved_mean"):
            train(desc, saved_mean=0)
    assert stub.calls() == only("forward_query", "reserve_query")  # at creation, no more


def test_a_reserve_of_a_problem_with_none_is_not_handed_to_cudnn(stub):
    """Where the reserve query answers 0 bytes, compute's reserve is unused: any address
    will do, and cuDNN is handed none (NULL, 0 bytes). Before, it was handed the pointer,
    and the stub refused a misaligned one (rule reserve-aligned)."""
    stub.reserve_bytes.value = 0
    with training((2, 3, 4, 5)) as desc:
        assert desc.reserve_size == 0
        for offset in (0, 1, 8):
            train(desc, reserve=RESERVE + offset, reserve_size=16)
            call = stub.forward_training
            assert (call.reserve, call.reserve_size) == (0, 0)
        assert call.calls == 3


def test_training_failure_raises_with_its_strings_and_a_repro(stub):
    stub.forward_training.status = 3003
    with training((2, 3, 4, 5), F16, F32) as desc, pytest.raises(BadTensorDtypeError) as caught:
        train(desc)
    message = str(caught.value)
    assert "cudnnBatchNormalizationForwardTrainingEx" in message
    assert "STUB_STATUS_3003 (3003)" in message and "stub detail for 3003" in message
    assert "To reproduce" in message and "momentum=0.1" in message


def test_training_descriptors_are_destroyed_with_the_operator(stub):
    gc.collect()
    before = stub.live_tensors.value
    desc = training((2, 3, 4, 5))
    assert stub.live_tensors.value == before + 3  # x, y and the derived one
    desc.set_attributes(eps=1e-3)  # rebuilt: the old ones are destroyed
    assert stub.live_tensors.value == before + 3
    desc.destroy()
    assert stub.live_tensors.value == before


# --- fused training forward: BN + ReLU, BN + Add + ReLU -------------------------------------


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=str)
def test_fused_training_arguments(stub, shape, fusion):
    add = fusion == "add_relu"
    gc.collect()
    live = (stub.live_tensors.value, stub.live_activations.value)
    strides = channels_last(shape)
    with training(shape, F16, F32, strides=strides, fusion=fusion, momentum=MOMENTUM) as desc:
        assert desc.engine == "cudnn"
        assert (desc.workspace_size, desc.reserve_size) == (STUB_WORKSPACE, STUB_RESERVE)
        assert stub.live_activations.value == live[1] + 1
        train(desc, **({"z": POINTERS["z"]} if add else {}))
        call = stub.forward_training
        assert call.calls == 1
        assert (call.mode, call.bn_ops) == (SPATIAL_PERSISTENT, FUSIONS[fusion])
        assert (call.alpha, call.beta) == (1, 0)
        assert stub.activation(call.activation_desc) == (ACTIVATION_RELU, PROPAGATE_NAN, 0.0)

        names = ["x_desc", "y_desc"] + (["z_desc"] if add else [])
        for name in names:
            assert stub.tensor(getattr(call, name)) == (CUDNN_HALF, shape, strides), name
        assert fields(call, "x y") == pointers("input output")
        assert call.z == (POINTERS["z"] if add else 0)
        assert add or call.z_desc == 0
        assert_derived_bn_desc(call.bn_desc, call.x_desc, SPATIAL_PERSISTENT, shape, F16)
        assert fields(call, "scale bias") == pointers("weight bias")
        assert call.exponential_average_factor == MOMENTUM
        assert_outputs_buffers_and_queries(stub)
    assert (stub.live_tensors.value, stub.live_activations.value) == live


def test_add_relu_training_needs_z(stub):
    shape = FUSED_SHAPES[0]
    with (
        training(shape, F16, F32, strides=channels_last(shape), fusion="add_relu") as desc,
        pytest.raises(NullPointerError, match="z is NULL"),
    ):
        train(desc, z=0)
    assert stub.forward_training.calls == 0


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("case", FUSED_ENGINES.values(), ids=list(FUSED_ENGINES))
def test_fused_training_engine(stub, fusion, case):
    engine, shape, dtype, channel_dtype, layout, persistent = case
    engine = fused_engine(engine, fusion)
    gc.collect()
    live = (stub.live_tensors.value, stub.live_activations.value)
    strides = layout_strides(shape, layout)
    with training(
        shape, dtype, channel_dtype, strides=strides, fusion=fusion, persistent=persistent
    ) as desc:
        assert desc.engine == engine
        if engine == "cupy":  # no cuDNN object, no size query, and compute runs CuPy only
            assert desc.reserve_size == 0
            assert (stub.live_tensors.value, stub.live_activations.value) == live
            with pytest.raises(AssertionError, match="CuPy stream scope"):
                train(desc, z=POINTERS["z"])
            assert nothing_recorded(stub)


# --- inference forward ----------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "dtype", "channel_dtype", "layout"), list(fast_cases()))
def test_inference_fast_path_arguments(stub, shape, dtype, channel_dtype, layout):
    strides = layout_strides(shape, layout)
    with inference(shape, dtype, channel_dtype, strides=strides, eps=1e-3) as desc:
        assert desc.engine == "cudnn"
        assert (desc.workspace_size, desc.reserve_size) == (0, 0)  # no query, no reserve
        infer(desc)
        call = stub.forward_inference
        assert stub.calls() == only("set_stream", "forward_inference")
        assert fields(stub.set_stream, "handle stream") == (call.handle, STREAM)

        bn_mode = expected_bn_mode(shape, layout, training=False)  # never PERSISTENT
        assert call.mode == bn_mode
        assert (call.alpha, call.beta) == (1, 0)
        expected = (CUDNN_TYPE[dtype], padded(shape), cudnn_strides(shape, layout))
        for name in ("x_desc", "y_desc"):
            assert stub.tensor(getattr(call, name)) == expected, name
        assert_derived_bn_desc(call.bn_desc, call.x_desc, bn_mode, shape, dtype)
        assert fields(call, "x y") == pointers("input output")
        names = "scale bias estimated_mean estimated_variance"
        assert fields(call, names) == pointers("weight bias running_mean running_var")
        assert call.epsilon == 1e-3


def test_inference_of_channels_last_is_spatial(stub):
    shape = (2, 8, 3, 5)
    with inference(shape, F16, F32, strides=channels_last(shape)) as desc:
        infer(desc)
    assert stub.forward_inference.mode == SPATIAL


def test_inference_refuses_null_pointers_before_cudnn(stub):
    with inference((2, 3, 4, 5)) as desc:
        for name in INFERENCE_ORDER:
            ptrs = [0 if n == name else POINTERS[n] for n in INFERENCE_ORDER]
            with pytest.raises(NullPointerError, match=name):
                desc.compute(0, 0, *ptrs, stream=STREAM)
    assert nothing_recorded(stub)


# --- the C API ------------------------------------------------------------------------------


def _capi_handle() -> c_void_p:
    assert capi.infinirtSetDevice(Device.NVIDIA, 0) == Status.SUCCESS
    handle = c_void_p()
    assert capi.infiniopCreateHandle(ctypes.byref(handle)) == Status.SUCCESS
    return handle


@pytest.mark.parametrize("running", ["both", "none"])
def test_capi_training_hands_cudnn_the_same_arguments(stub, running):
    shape = (2, 8, 3, 5)
    x, channel = operands(shape, F16, F32, channels_last(shape))
    stats = channel if running == "both" else None
    handle, desc = _capi_handle(), c_void_p()
    descs = [capi_tensor(d) for d in (x, channel, channel, x, channel, channel, stats, stats)]
    create = capi.infiniopCreateBatchNormForwardTrainingDescriptor
    assert create(handle, ctypes.byref(desc), *descs) == Status.SUCCESS, capi.last_error()
    set_attributes = capi.infiniopSetBatchNormForwardTrainingAttributes
    assert set_attributes(desc, 1e-3, MOMENTUM) == Status.SUCCESS
    workspace, reserve = c_size_t(), c_size_t()
    get_workspace = capi.infiniopGetBatchNormForwardTrainingWorkspaceSize
    assert get_workspace(desc, ctypes.byref(workspace)) == Status.SUCCESS
    get_reserve = capi.infiniopGetBatchNormForwardTrainingReserveSize
    assert get_reserve(desc, ctypes.byref(reserve)) == Status.SUCCESS
    assert (workspace.value, reserve.value) == (STUB_WORKSPACE, STUB_RESERVE)

    ptrs = [c_void_p(POINTERS[name]) for name in TRAINING_ORDER]
    sizes = (c_void_p(WORKSPACE), workspace.value, c_void_p(RESERVE), reserve.value)
    args = (desc, *sizes, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormForwardTraining(*args) == Status.SUCCESS, capi.last_error()
    call = stub.forward_training
    assert call.calls == 1
    assert stub.set_stream.stream == STREAM
    assert (call.mode, call.bn_ops, call.epsilon) == (SPATIAL_PERSISTENT, OPS_BN, 1e-3)
    assert call.exponential_average_factor == MOMENTUM
    assert stub.tensor(call.x_desc) == (CUDNN_HALF, shape, channels_last(shape))
    assert fields(call, "x y scale bias") == pointers("input output weight bias")
    assert fields(call, "save_mean save_inv_variance") == pointers("saved_mean saved_invstd")
    running_ptrs = fields(call, "running_mean running_var")
    assert running_ptrs == (pointers("running_mean running_var") if stats else (0, 0))
    assert fields(call, "workspace workspace_size") == (WORKSPACE, STUB_WORKSPACE)
    assert fields(call, "reserve reserve_size") == (RESERVE, STUB_RESERVE)

    # Refused before cuDNN: a small reserve, a NULL reserve.
    small = (desc, *sizes[:3], reserve.value - 1, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormForwardTraining(*small) == Status.INSUFFICIENT_WORKSPACE
    null = (desc, *sizes[:2], None, reserve.value, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormForwardTraining(*null) == Status.NULL_POINTER
    assert "reserve is NULL" in capi.last_error()
    assert call.calls == 1

    stub.forward_training.status = 3003
    assert capi.infiniopBatchNormForwardTraining(*args) == Status.BAD_TENSOR_DTYPE
    assert "STUB_STATUS_3003" in capi.last_error() and "To reproduce" in capi.last_error()

    destroy = capi.infiniopDestroyBatchNormForwardTrainingDescriptor
    assert destroy(desc) == Status.SUCCESS
    assert destroy(desc) == Status.BAD_PARAM
    for d in descs:
        assert not d.value or capi.infiniopDestroyTensorDescriptor(d) == Status.SUCCESS
    assert capi.infiniopDestroyHandle(handle) == Status.SUCCESS


def test_capi_inference_hands_cudnn_the_same_arguments(stub):
    shape = (2, 3, 4, 5)
    x, channel = operands(shape, F32, F32, None)
    handle, desc, size = _capi_handle(), c_void_p(), c_size_t()
    descs = [capi_tensor(d) for d in (x, x, channel, channel, channel, channel)]
    create = capi.infiniopCreateBatchNormForwardInferenceDescriptor
    assert create(handle, ctypes.byref(desc), *descs) == Status.SUCCESS, capi.last_error()
    assert capi.infiniopSetBatchNormForwardInferenceAttributes(desc, 1e-3) == Status.SUCCESS
    get_workspace = capi.infiniopGetBatchNormForwardInferenceWorkspaceSize
    assert get_workspace(desc, ctypes.byref(size)) == Status.SUCCESS
    assert size.value == 0

    ptrs = [c_void_p(POINTERS[name]) for name in INFERENCE_ORDER]
    args = (desc, None, 0, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormForwardInference(*args) == Status.SUCCESS, capi.last_error()
    call = stub.forward_inference
    assert call.calls == 1
    assert stub.set_stream.stream == STREAM
    assert (call.mode, call.epsilon, call.alpha, call.beta) == (SPATIAL, 1e-3, 1, 0)
    assert stub.tensor(call.x_desc) == (CUDNN_TYPE[F32], shape, contiguous_strides(shape))
    assert fields(call, "x y") == pointers("input output")
    names = "scale bias estimated_mean estimated_variance"
    assert fields(call, names) == pointers("weight bias running_mean running_var")

    null_x = (*args[:4], None, *args[5:])
    assert capi.infiniopBatchNormForwardInference(*null_x) == Status.NULL_POINTER
    assert "input is NULL" in capi.last_error()
    assert call.calls == 1

    destroy = capi.infiniopDestroyBatchNormForwardInferenceDescriptor
    assert destroy(desc) == Status.SUCCESS
    assert destroy(desc) == Status.BAD_PARAM
    for d in descs:
        assert capi.infiniopDestroyTensorDescriptor(d) == Status.SUCCESS
    assert capi.infiniopDestroyHandle(handle) == Status.SUCCESS


def test_fast_dtypes_are_the_ones_cudnn_derives(stub):
    """The fast path's per-channel dtypes are what cuDNN derives, so nothing is staged."""
    for dtype, channel_dtype in FAST_DTYPES:
        with training((2, 3, 4, 5), dtype, channel_dtype) as desc:
            assert desc.workspace_size == STUB_WORKSPACE


@pytest.mark.parametrize(("batch", "engine"), [(65535, "cudnn"), (65536, "cupy")])
def test_inference_batch_limit(stub, batch, engine):
    """PyTorch's guard for cuDNN's inference kernels: at most 65535 samples."""
    with inference((batch, 2, 1)) as desc:
        assert desc.engine == engine


@pytest.mark.parametrize(("batch", "engine"), [(880801, "cudnn"), (880802, "cupy")])
def test_training_batch_limit(stub, batch, engine):
    """PyTorch's guard for cuDNN's training kernels: at most 880801 samples."""
    with training((batch, 2, 1)) as desc:
        assert desc.engine == engine


@pytest.mark.parametrize("shape", [(6, 3), (131071, 2), (880801, 2)])
def test_2d_input_goes_to_cupy(stub, shape):
    """PyTorch sends no 2-D input to cuDNN (its PER_ACTIVATION mode: PR 57034, issue 2917)."""
    with training(shape) as desc:
        assert desc.engine == "cupy"
    with inference(shape) as desc:
        assert desc.engine == "cupy"
    assert nothing_recorded(stub)
