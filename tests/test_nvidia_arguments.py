"""The exact arguments the NVIDIA backend hands cuDNN's batch-norm backward, checked without
a GPU.

The stub libcudnn of ``cudnn_stub.py`` stands in for the real one and records what each
cuDNN function was given. The tests build descriptors through the operator layer and the C
API, compute on fake device pointers, and read back what cuDNN would have been given: plain
and fused (BN+ReLU, BN+Add+ReLU) backward, output masks, the reserve space, the engine
choice. ``test_nvidia_forward_arguments.py`` does the same for the forward passes.
"""

import ctypes
import gc
import itertools
import math
import threading
from ctypes import c_size_t, c_void_p

import pytest
from c_headers import cudnn_functions, parse_functions
from cudnn_stub import (
    ACTIVATION_RELU,
    BF16,
    CUDNN_FLOAT,
    CUDNN_HALF,
    CUDNN_TYPE,
    F16,
    F32,
    F64,
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
    STUB_DECLARATIONS,
    STUB_RESERVE,
    STUB_VERSION,
    STUB_WORKSPACE,
    WORKSPACE,
    assert_derived_bn_desc,
    capi_tensor,
    cudnn_strides,
    fast_cases,
    fields,
    forward_filled,
    fused_engine,
    in_workspace,
    layout_strides,
    nothing_recorded,
    only,
    padded,
    pointers,
)
from helpers import BACKWARD_ORDER, OUTPUTS, channels_last

import cudnn_bn
from cudnn_bn import BatchNormBackwardDescriptor, Device, Mode, Status, TensorDesc, capi
from cudnn_bn._cudnn import library as library_module
from cudnn_bn._cudnn.library import CudnnLibrary
from cudnn_bn._cudnn.loader import CudnnInfo
from cudnn_bn._cudnn.prototypes import PROTOTYPES
from cudnn_bn.backends.cudnn_engines import CudnnBatchNormBackward
from cudnn_bn.errors import (
    BadParamError,
    BadTensorDtypeError,
    BadTensorShapeError,
    InfiniError,
    InsufficientWorkspaceError,
    NullPointerError,
)
from cudnn_bn.tensor import contiguous_strides

# --- problems on fake device pointers ------------------------------------------------------


def tensors(shape, dtype=F32, channel_dtype=None, *, strides=None, dy_strides=None):
    """The eight descriptors in the spec's order: grad_input, grad_weight, grad_bias, input,
    grad_output, weight, running_mean, running_var."""
    strides = strides or contiguous_strides(shape)
    channel = TensorDesc.contiguous(channel_dtype or dtype, (shape[1],))
    x = TensorDesc(dtype, shape, strides)
    dy = TensorDesc(dtype, shape, dy_strides or strides)
    dx = TensorDesc(dtype, shape, strides)
    return [dx, channel, channel, x, dy, channel, channel, channel]


def descriptor(
    shape, dtype=F32, channel_dtype=None, *, strides=None, dy_strides=None, fusion=None, **attrs
):
    """A backward descriptor; a fused one also gets output and bias (and grad_z for the add)
    descriptors like the input's and the weight's. ``attrs``: eps, mode, output_mask,
    persistent."""
    descs = tensors(shape, dtype, channel_dtype, strides=strides, dy_strides=dy_strides)
    if fusion is not None:
        attrs |= {"fusion": fusion, "output_desc": descs[3], "bias_desc": descs[5]}
        if fusion == "add_relu":
            attrs["grad_z_desc"] = descs[0]
    return BatchNormBackwardDescriptor(cudnn_bn.Handle(Device.NVIDIA, 0), *descs, **attrs)


def compute(desc, workspace_size=None, *, workspace=WORKSPACE, stream=STREAM, **overrides):
    """``desc.compute`` on the fake pointers; ``overrides`` replace some, or add the fused
    operands (``output``, ``bias``, ``grad_z``, ``reserve``) and ``reserve_size``."""
    ptrs = {**POINTERS, **overrides}
    if overrides.get("reserve") and desc.engine == "cudnn":
        forward_filled(desc, overrides["reserve"])
    size = desc.workspace_size if workspace_size is None else workspace_size
    extra = {name: value for name, value in overrides.items() if name not in BACKWARD_ORDER}
    desc.compute(workspace, size, *(ptrs[name] for name in BACKWARD_ORDER), stream=stream, **extra)


def fused_pointers(fusion):
    """The operands a ``fusion`` backward adds, and the reserve's size, for ``compute``."""
    names = ("output", "bias", "reserve") + (("grad_z",) if fusion == "add_relu" else ())
    return {name: POINTERS[name] for name in names} | {"reserve_size": STUB_RESERVE}


# --- the stub itself -----------------------------------------------------------------------


def test_stub_declares_every_prototype_as_cudnn_does():
    declared = parse_functions(STUB_DECLARATIONS)
    headers = cudnn_functions()
    for name in PROTOTYPES:
        assert name in declared, f"the stub does not define {name}; add it"
        stub_types = (declared[name].returns, [p.type for p in declared[name].params])
        header_types = (headers[name].returns, [p.type for p in headers[name].params])
        assert stub_types == header_types, name


def test_stub_exports_every_prototype(stub):
    missing = [name for name in PROTOTYPES if not hasattr(stub.cdll, name)]
    assert not missing
    assert cudnn_bn.cudnn_info().version == STUB_VERSION


LAYOUTS = [((6, 3), (3, 1)), ((2, 3, 5), (15, 1, 3)), ((2, 3, 4, 5), (60, 1, 15, 3))]


@pytest.mark.parametrize(("shape", "strides"), LAYOUTS)
@pytest.mark.parametrize("dtype", [F16, F32, F64], ids=lambda d: d.name)
def test_stub_descriptors_agree_with_real_cudnn(stub_path, monkeypatch, shape, strides, dtype):
    """Set, derive and read back give the same answers from the stub as from libcudnn."""
    from cudnn_bn._cudnn.enums import BatchNormMode
    from cudnn_bn._cudnn.tensor import TensorDescriptor

    try:
        real = library_module.cudnn()
    except InfiniError as exc:
        pytest.skip(f"no real libcudnn to compare with: {exc}")
    fake = CudnnLibrary(ctypes.CDLL(str(stub_path)), real.info)
    answers = []
    for lib in (real, fake):
        monkeypatch.setattr(library_module, "_library", lib)
        with TensorDescriptor.nd(CUDNN_TYPE[dtype], shape, strides) as x:
            derived = [TensorDescriptor.derive_bn(x, mode) for mode in BatchNormMode]
            answers.append([x.read()] + [d.read() for d in derived])
            for d in derived:
                d.close()
    assert answers[0] == answers[1]


# --- the cuDNN fast path: every argument ---------------------------------------------------


@pytest.mark.parametrize(("shape", "dtype", "channel_dtype", "layout"), list(fast_cases()))
def test_fast_path_arguments(stub, shape, dtype, channel_dtype, layout):
    strides = layout_strides(shape, layout)
    with descriptor(shape, dtype, channel_dtype, eps=1e-3, strides=strides) as desc:
        assert desc.engine == "cudnn"
        assert desc.workspace_size == STUB_WORKSPACE
        assert desc.reserve_size == 0  # a train-mode backward reads no forward's reserve
        compute(desc)
        call, query = stub.backward, stub.backward_query
        assert stub.calls() == only("set_stream", "backward_query", "backward")

        # The handle, on the caller's stream.
        assert call.handle != 0
        assert stub.set_stream.handle == call.handle
        assert stub.set_stream.stream == STREAM

        # Train mode, no saved statistics: SPATIAL, never PERSISTENT (finding 1).
        bn_mode = SPATIAL
        assert (call.mode, call.bn_ops) == (bn_mode, OPS_BN)
        assert (call.alpha_data, call.beta_data, call.alpha_param, call.beta_param) == (1, 0, 1, 0)

        # x, dy and dx: the input's dims (padded to 4-D), packed strides and dtype.
        expected = (CUDNN_TYPE[dtype], padded(shape), cudnn_strides(shape, layout))
        for name in ("x_desc", "dy_desc", "dx_desc"):
            assert stub.tensor(getattr(call, name)) == expected, name
        # The per-channel descriptor is the one derived from x's for this mode.
        assert_derived_bn_desc(call.bn_desc, call.x_desc, bn_mode, shape, dtype)

        # No fused add or activation.
        assert (call.y_desc, call.y, call.dz_desc, call.dz, call.bias) == (0, 0, 0, 0, 0)
        assert call.activation_desc == 0

        assert fields(call, "x dy dx") == pointers("input grad_output grad_input")
        assert fields(call, "scale dscale dbias") == pointers("weight grad_weight grad_bias")
        assert call.epsilon == 1e-3
        assert (call.saved_mean, call.saved_inv_variance) == (0, 0)  # train: recomputed
        assert (call.workspace, call.workspace_size) == (WORKSPACE, STUB_WORKSPACE)
        assert (call.reserve, call.reserve_size) == (0, 0)  # none given

        # The workspace was asked for the very descriptors the call got.
        assert (query.handle, query.mode, query.bn_ops) == (call.handle, bn_mode, OPS_BN)
        descs = "x_desc dy_desc dx_desc bn_desc"
        assert fields(query, descs) == fields(call, descs)
        # A plain call has no y; its size query gets x's descriptor there (PyTorch's
        # cudnn_batch_norm_backward and CuPy 13 do so), not NULL.
        assert query.y_desc == call.x_desc
        assert (query.dz_desc, query.activation_desc) == (0, 0)


@pytest.mark.parametrize("how", ["Mode.SAVED_INVSTD", "set_attributes"])
@pytest.mark.parametrize(("dtype", "channel_dtype"), FAST_DTYPES, ids=lambda d: d.name)
def test_saved_invstd_hands_cudnn_the_statistics(stub, how, dtype, channel_dtype):
    shape = (2, 3, 4, 5)
    if how == "set_attributes":
        desc = descriptor(shape, dtype, channel_dtype)
        desc.set_attributes(1e-4, "saved_invstd")
    else:
        desc = descriptor(shape, dtype, channel_dtype, eps=1e-4, mode=Mode.SAVED_INVSTD)
    with desc:
        assert (desc.engine, desc.workspace_size) == ("cudnn", STUB_WORKSPACE)
        compute(desc)
    call = stub.backward
    assert call.calls == 1
    assert fields(call, "saved_mean saved_inv_variance") == pointers("running_mean running_var")
    assert call.epsilon == 1e-4
    assert (call.alpha_data, call.beta_data, call.alpha_param, call.beta_param) == (1, 0, 1, 0)


def test_train_mode_takes_null_running_statistics(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        compute(desc, running_mean=0, running_var=0)
    assert stub.backward.calls == 1
    assert (stub.backward.saved_mean, stub.backward.saved_inv_variance) == (0, 0)


def test_stream_zero_is_the_legacy_default(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        compute(desc, stream=0)
    assert (stub.set_stream.calls, stub.set_stream.stream) == (1, 0)


def test_threads_take_turns_with_the_pooled_handle(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        compute(desc)
        first = stub.backward.handle
        worker = threading.Thread(target=compute, args=(desc,))
        worker.start()
        worker.join()
    assert stub.backward.calls == 2
    assert stub.backward.handle == first != 0  # given back after each compute, not per thread
    assert stub.set_stream.handle == stub.backward.handle


SIZE_ONE_STRIDES = {  # (shape, strides of x; dy and dx packed), layout: a size-1 axis's
    # stride is never stepped, so it is free in memory but must be the packed one for cuDNN.
    "broadcast H (stride 0)": ((2, 3, 1, 5), (15, 5, 0, 1), "contiguous"),
    "N = 1 with a stray stride": ((1, 3, 4, 5), (999, 20, 5, 1), "contiguous"),
    "NHWC with H = 1": ((2, 3, 1, 5), (15, 1, 7, 3), "channels_last"),
}


@pytest.mark.parametrize(
    ("shape", "strides", "layout"), SIZE_ONE_STRIDES.values(), ids=list(SIZE_ONE_STRIDES)
)
def test_size_one_axes_get_packed_strides(stub, shape, strides, layout):
    packed = channels_last(shape) if layout == "channels_last" else contiguous_strides(shape)
    desc_tensors = tensors(shape, strides=packed)
    desc_tensors[3] = TensorDesc(F32, shape, strides)
    with BatchNormBackwardDescriptor(cudnn_bn.Handle(Device.NVIDIA, 0), *desc_tensors) as desc:
        assert desc.engine == "cudnn"
        compute(desc)
        expected = (CUDNN_FLOAT, shape, cudnn_strides(shape, layout))
        for name in ("x_desc", "dy_desc", "dx_desc"):  # read while the descriptors live
            assert stub.tensor(getattr(stub.backward, name)) == expected, name


# --- staging through the workspace: sizes only (the conversions are CuPy kernels) ----------


def _round_up(n: int) -> int:
    return -(-n // 256) * 256


@pytest.mark.parametrize(
    ("dtype", "channel_dtype", "mode", "slices"),
    [
        (F16, F16, "train", 3),  # weight in, grad_weight and grad_bias out, each as F32
        (F16, F16, "saved_invstd", 5),  # ... and running_mean, running_var in
        (F32, F32, "saved", 1),  # running_var in, as 1/sqrt(var + eps)
    ],
)
def test_staging_slices_follow_cudnn_workspace(stub, dtype, channel_dtype, mode, slices):
    channels = 3
    with descriptor((2, channels, 4, 5), dtype, channel_dtype, mode=mode) as desc:
        assert desc.engine == "cudnn"
        expected = STUB_WORKSPACE
        for _ in range(slices):  # F32 slices, each 256-byte aligned, after cuDNN's own
            expected = _round_up(expected) + 4 * channels
        assert desc.workspace_size == expected > STUB_WORKSPACE
        assert desc.reserve_size == (0 if mode == "train" else STUB_RESERVE)


# --- calls refused before cuDNN ------------------------------------------------------------


@pytest.mark.parametrize("offset", [1, 8])
def test_a_misaligned_workspace_is_refused_before_cudnn(stub, offset):
    """Finding 7: the workspace holds F64 scratch and cuDNN's own: 16-byte aligned or
    BAD_PARAM, before anything is written."""
    with (
        descriptor((2, 3, 4, 5), F64) as desc,
        pytest.raises(BadParamError, match="16-byte aligned"),
    ):
        compute(desc, workspace=WORKSPACE + offset)
    assert stub.backward.calls == 0  # the C API's case: test_capi_hands_cudnn_the_same_...


def test_small_workspace_is_refused_before_cudnn(stub):
    with descriptor((2, 3, 4, 5)) as desc:
        with pytest.raises(InsufficientWorkspaceError) as caught:
            compute(desc, desc.workspace_size - 1)
        assert caught.value.status == Status.INSUFFICIENT_WORKSPACE
        with pytest.raises(NullPointerError):
            compute(desc, workspace=0)
    assert (stub.backward.calls, stub.set_stream.calls) == (0, 0)


@pytest.mark.parametrize("name", BACKWARD_ORDER)
def test_null_data_pointer_is_refused_before_cudnn(stub, name):
    with (
        descriptor((2, 3, 4, 5), mode="saved_invstd") as desc,
        pytest.raises(NullPointerError, match=name),
    ):
        compute(desc, **{name: 0})
    assert (stub.backward.calls, stub.set_stream.calls) == (0, 0)


@pytest.mark.parametrize("over", ["grad_output", "input"])
def test_grad_input_exactly_on_a_read_data_tensor_reaches_cudnn(stub, over):
    """In place as InfiniCore's own tests run the backward: grad_input at the address of a
    read data tensor of its layout is handed to cuDNN as it is (whether cuDNN's result is
    right in place only a GPU shows: ``test_gpu.py::test_capi_with_device_pointers``)."""
    with descriptor((2, 3, 4, 5), mode="saved_invstd") as desc:
        compute(desc, grad_input=POINTERS[over])
    call, field = stub.backward, {"grad_output": "dy", "input": "x"}[over]
    assert call.calls == 1 and call.dx == POINTERS[over] == getattr(call, field)


@pytest.mark.parametrize(
    ("overrides", "dy_strides"),
    [
        ({"grad_input": POINTERS["grad_output"] + 4}, None),  # one element along
        ({"grad_input": POINTERS["grad_output"]}, channels_last((2, 3, 4, 5))),  # other layout
        ({"grad_weight": POINTERS["input"] + 8}, None),  # a per-channel result in the data
    ],
    ids=["shifted", "other layout", "per-channel"],
)
def test_other_overlaps_are_refused_before_cudnn(stub, overrides, dy_strides):
    """A written tensor over another argument other than exactly in place is BAD_PARAM on
    the NVIDIA engine, which cuDNN would read as it writes it (the CPU engine writes such a
    data output through scratch instead)."""
    with (
        descriptor((2, 3, 4, 5), mode="saved_invstd", dy_strides=dy_strides) as desc,
        pytest.raises(BadParamError, match="share memory"),
    ):
        compute(desc, **overrides)
    assert stub.backward.calls == 0


# --- which engine ---------------------------------------------------------------------------

BIG = 2**31  # elements: cuDNN indexes with 32 bits
ENGINES = {
    "F32 NCHW": ("cudnn", (2, 3, 4, 5), F32, {}, {}),
    "F16 NHWC": ("cudnn", (2, 3, 4, 5), F16, {"strides": channels_last((2, 3, 4, 5))}, {}),
    "eval": ("cupy", (2, 3, 4, 5), F32, {}, {"mode": "eval"}),
    "BF16": ("cupy", (2, 3, 4, 5), BF16, {}, {}),
    "BF16 with F32 statistics": ("cupy", (2, 3, 4, 5), BF16, {"channel_dtype": F32}, {}),
    "padded (13,2,4)/(10,4,1)": ("cupy", (13, 2, 4), F32, {"strides": (10, 4, 1)}, {}),
    "padded dy only": ("cupy", (13, 2, 4), F32, {"dy_strides": (10, 4, 1)}, {}),
    "NCHW x, NHWC dy": ("cupy", (2, 3, 4, 5), F32, {"dy_strides": channels_last((2, 3, 4, 5))}, {}),
    "numel 2^31": ("cupy", (2**16, 2**15), F32, {}, {}),
    "numel 2^31 + 2^16": ("cupy", (2**16, 2**15 + 1), F16, {"channel_dtype": F32}, {}),
    "eps 0 on cuDNN 9": ("cudnn", (2, 3, 4, 5), F32, {}, {"eps": 0.0}),
    # PyTorch's guards: numel < 2^31 - 1, and N <= 880801 in training.
    "numel 2^31 - 2": ("cudnn", (2, 1, 2**30 - 1), F32, {}, {}),
    "numel 2^31 - 1": ("cupy", (1, 1, 2**31 - 1), F32, {}, {}),
    "N 880801": ("cudnn", (880801, 2, 1), F32, {}, {}),
    "N 880802": ("cupy", (880802, 2, 1), F32, {}, {}),
    # PyTorch sends no 2-D input to cuDNN (PER_ACTIVATION: PR 57034, issue 2917).
    "2-D (6, 3)": ("cupy", (6, 3), F32, {}, {}),
    "2-D N 131071": ("cupy", (131071, 2), F32, {}, {}),
    "2-D F16": ("cupy", (6, 4), F16, {"channel_dtype": F32}, {"mode": "saved"}),
}


@pytest.mark.parametrize(
    ("engine", "shape", "dtype", "layout", "attributes"), ENGINES.values(), ids=list(ENGINES)
)
def test_engine_choice(stub, engine, shape, dtype, layout, attributes):
    before = stub.live_tensors.value
    with descriptor(shape, dtype, **layout, **attributes) as desc:
        assert desc.engine == engine
        if engine == "cupy":  # no cuDNN object and no size query behind a CuPy engine
            assert desc.reserve_size == 0
            assert (stub.live_tensors.value, stub.backward_query.calls) == (before, 0)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_small_eps_goes_to_cudnn_8_unclamped(stub, monkeypatch, eps):
    """CUDNN_BN_MIN_EPSILON is 0 since cuDNN 7.6 (1e-5 was cuDNN <= 7.4's): no eps floor."""
    cudnn8 = CudnnInfo(path="libcudnn.so.8", found_via="test stub", version=8907)
    monkeypatch.setattr(library_module.cudnn(), "info", cudnn8)
    with descriptor((2, 3, 4, 5), eps=eps) as desc:
        assert desc.engine == "cudnn"
        compute(desc)
    assert stub.backward.epsilon == eps


# --- a cuDNN failure ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error"), [(3003, BadTensorDtypeError), (3002, BadTensorShapeError)]
)
def test_cudnn_failure_raises_with_its_strings_and_a_repro(stub, code, error):
    stub.backward.status = code
    with descriptor((2, 3, 4, 5), F16, F32, eps=1e-3) as desc, pytest.raises(error) as caught:
        compute(desc)
    message = str(caught.value)
    assert "cudnnBatchNormalizationBackwardEx" in message
    assert f"STUB_STATUS_{code} ({code})" in message  # cudnnGetErrorString
    assert f"stub detail for {code}" in message  # cudnnGetLastErrorString
    assert "To reproduce" in message
    assert "shape (2, 3, 4, 5)" in message
    assert "eps=0.001" in message and "mode='train'" in message
    assert stub.backward.calls == 1


# --- lifetimes ------------------------------------------------------------------------------


def test_cudnn_descriptors_are_destroyed_with_the_operator(stub):
    gc.collect()
    before = stub.live_tensors.value
    desc = descriptor((2, 3, 4, 5))
    assert stub.live_tensors.value == before + 4  # x, dy, dx and the derived one
    desc.set_attributes(1e-3, "saved_invstd")  # rebuilt: the old ones are destroyed
    assert stub.live_tensors.value == before + 4
    desc.destroy()
    assert stub.live_tensors.value == before
    with pytest.raises(BadParamError):
        desc.destroy()
    with pytest.raises(BadParamError):
        compute(desc, STUB_WORKSPACE)
    assert stub.backward.calls == 0


@pytest.mark.parametrize("fusion", [None, "relu"])
def test_a_failed_build_destroys_the_descriptors_it_made(stub, monkeypatch, fusion):
    def refuse(self):
        raise InfiniError(Status.INTERNAL_ERROR, "reserve size query refused")

    monkeypatch.setattr(CudnnBatchNormBackward, "reserve_query", refuse)
    gc.collect()
    before = (stub.live_tensors.value, stub.live_activations.value)
    shape = FUSED_SHAPES[0]
    with pytest.raises(InfiniError, match="reserve size query refused") as caught:
        descriptor(shape, F16, F32, strides=channels_last(shape), fusion=fusion, mode="saved")
    # Built as far as the queries before the failing one (a plain persistent backward also
    # sizes the SPATIAL call it makes when given no reserve).
    assert stub.backward_query.calls == (2 if fusion is None else 1)
    # Destroyed at once, not when the collector gets to the half-built engine (which the
    # traceback held here still keeps alive).
    assert caught.traceback
    assert (stub.live_tensors.value, stub.live_activations.value) == before


# --- the persistent attribute ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "layout", "persistent", "mode"), PERSISTENT_CASES.values(), ids=list(PERSISTENT_CASES)
)
def test_persistent_attribute_picks_the_mode(stub, shape, layout, persistent, mode):
    """A backward from its forward's saved statistics and reserve runs in the forward's mode."""
    strides = layout_strides(shape, layout)
    attrs = {"persistent": persistent, "mode": "saved_invstd"}
    with descriptor(shape, F16, F32, strides=strides, **attrs) as desc:
        assert desc.engine == "cudnn"
        compute(desc, reserve=POINTERS["reserve"], reserve_size=STUB_RESERVE)
        call = stub.backward
        assert (call.mode, stub.backward_query.mode, stub.reserve_query.mode) == (mode,) * 3
        assert_derived_bn_desc(call.bn_desc, call.x_desc, mode, shape, F16)
        assert fields(call, "reserve reserve_size") == (POINTERS["reserve"], STUB_RESERVE)


@pytest.mark.parametrize(
    ("shape", "layout", "persistent", "mode"), PERSISTENT_CASES.values(), ids=list(PERSISTENT_CASES)
)
def test_train_mode_backward_runs_in_spatial(stub, shape, layout, persistent, mode):
    """Finding 1: cuDNN wants saved statistics in a SPATIAL_PERSISTENT backward; a train-mode
    one has none, so it runs in SPATIAL (which computes them) and passes no reserve."""
    strides = layout_strides(shape, layout)
    with descriptor(shape, F16, F32, strides=strides, persistent=persistent) as desc:
        assert (desc.engine, desc.reserve_size) == ("cudnn", 0)
        compute(desc, reserve=POINTERS["reserve"], reserve_size=STUB_RESERVE)
        call = stub.backward
        assert (call.calls, call.mode, stub.backward_query.mode) == (1, SPATIAL, SPATIAL)
        assert fields(call, "saved_mean saved_inv_variance reserve reserve_size") == (0,) * 4
        assert_derived_bn_desc(call.bn_desc, call.x_desc, SPATIAL, shape, F16)


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_a_backward_given_no_reserve_runs_in_spatial(stub, layout):
    """Finding 2: a backward from saved statistics given no reserve (the C API has no
    operand for it) runs in SPATIAL, which needs none; given one, in the forward's mode."""
    shape = (2, 3, 4, 5)
    strides = layout_strides(shape, layout)
    with descriptor(shape, F16, F32, strides=strides, mode="saved_invstd", persistent=True) as desc:
        compute(desc)
        call = stub.backward
        assert (call.mode, call.reserve, call.reserve_size) == (SPATIAL, 0, 0)
        assert_derived_bn_desc(call.bn_desc, call.x_desc, SPATIAL, shape, F16)
        assert call.workspace_size == STUB_WORKSPACE
        compute(desc, reserve=POINTERS["reserve"], reserve_size=STUB_RESERVE)
        assert (call.calls, call.mode) == (2, SPATIAL_PERSISTENT)
        assert_derived_bn_desc(call.bn_desc, call.x_desc, SPATIAL_PERSISTENT, shape, F16)


# --- the output mask ------------------------------------------------------------------------


@pytest.mark.parametrize("masked", ["NULL", "given"])
@pytest.mark.parametrize(("dtype", "channel_dtype"), FAST_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(
    "mask",
    list(itertools.product((True, False), repeat=3)),
    ids=lambda m: "".join("xwb"[i] if wanted else "-" for i, wanted in enumerate(m)),
)
def test_unwanted_gradients_go_to_the_workspace(stub, mask, dtype, channel_dtype, masked):
    """cuDNN always writes dx, dscale and dbias: those nobody asked for land in workspace
    slices after cuDNN's own scratch, never at the caller's pointer (NULL or not)."""
    shape = (2, 3, 4, 5)
    wanted = dict(zip(OUTPUTS, mask, strict=True))
    param_bytes = 8 if channel_dtype == F64 else 4
    nbytes = {
        "grad_input": math.prod(shape) * (2 if dtype == F16 else param_bytes),
        "grad_weight": shape[1] * param_bytes,
        "grad_bias": shape[1] * param_bytes,
    }
    with descriptor(shape, dtype, channel_dtype, output_mask=mask) as desc:
        assert desc.engine == "cudnn"
        unwanted = [name for name in OUTPUTS if not wanted[name]]
        assert desc.workspace_size >= STUB_WORKSPACE + sum(nbytes[name] for name in unwanted)
        if not unwanted:
            assert desc.workspace_size == STUB_WORKSPACE
        caller = {name: 0 if masked == "NULL" else POINTERS[name] for name in unwanted}
        compute(desc, **caller)
        call = stub.backward
        assert call.calls == 1
        assert call.workspace_size == STUB_WORKSPACE  # cuDNN's own part of the workspace
        given = dict(zip(OUTPUTS, fields(call, "dx dscale dbias"), strict=True))
        for name in OUTPUTS:
            if wanted[name]:
                assert given[name] == POINTERS[name], name
            else:
                assert in_workspace(given[name], nbytes[name], desc.workspace_size), name
        spans = sorted((given[name], given[name] + nbytes[name]) for name in unwanted)
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_output_mask_must_be_three_booleans(stub):
    for mask in [(True, False), (1, 0, 1), "xwb"]:
        with pytest.raises(BadParamError, match="output_mask"):
            descriptor((2, 3, 4, 5), output_mask=mask)


# --- the reserve space ----------------------------------------------------------------------


def test_plain_backward_passes_a_given_reserve(stub):
    shape = (2, 3, 4, 5)
    with descriptor(shape, F16, F32, strides=channels_last(shape), mode="saved_invstd") as desc:
        compute(desc, reserve=POINTERS["reserve"], reserve_size=desc.reserve_size + 64)
        reserve = POINTERS["reserve"], STUB_RESERVE  # the descriptor's size, not the caller's
        assert fields(stub.backward, "reserve reserve_size") == reserve
        compute(desc)  # none given: none passed
        assert fields(stub.backward, "calls reserve reserve_size") == (2, 0, 0)
        with pytest.raises(InsufficientWorkspaceError, match="reserve_size"):
            compute(desc, reserve=POINTERS["reserve"], reserve_size=STUB_RESERVE - 1)
    assert stub.backward.calls == 2


def test_sizes_are_what_cudnn_answers(stub):
    stub.workspace_bytes.value, stub.reserve_bytes.value = 5000, 777
    with descriptor((2, 3, 4, 5), mode="saved_invstd") as desc:
        assert (desc.workspace_size, desc.reserve_size) == (5000, 777)
        compute(desc, reserve=POINTERS["reserve"], reserve_size=777)
    assert fields(stub.backward, "workspace_size reserve_size") == (5000, 777)


# --- fused backward: BN + ReLU, BN + Add + ReLU ---------------------------------------------


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=str)
def test_fused_backward_arguments(stub, shape, fusion):
    add = fusion == "add_relu"
    gc.collect()
    before = stub.live_activations.value
    strides = channels_last(shape)
    with descriptor(
        shape, F16, F32, strides=strides, fusion=fusion, eps=1e-4, mode="saved_invstd"
    ) as desc:
        assert desc.engine == "cudnn"
        assert (desc.workspace_size, desc.reserve_size) == (STUB_WORKSPACE, STUB_RESERVE)
        assert stub.live_activations.value == before + 1
        compute(desc, **fused_pointers(fusion))
        call, query, reserve = stub.backward, stub.backward_query, stub.reserve_query
        assert call.calls == 1
        assert (call.mode, call.bn_ops) == (SPATIAL_PERSISTENT, FUSIONS[fusion])
        assert (call.alpha_data, call.beta_data, call.alpha_param, call.beta_param) == (1, 0, 1, 0)
        assert stub.activation(call.activation_desc) == (ACTIVATION_RELU, PROPAGATE_NAN, 0.0)

        # x, y (the forward's output), dy, dx and, with the add, dz: one layout.
        names = ["x_desc", "y_desc", "dy_desc", "dx_desc"] + (["dz_desc"] if add else [])
        for name in names:
            assert stub.tensor(getattr(call, name)) == (CUDNN_HALF, shape, strides), name
        assert fields(call, "x y dy dx") == pointers("input output grad_output grad_input")
        assert call.dz == (POINTERS["grad_z"] if add else 0)
        assert add or call.dz_desc == 0
        assert_derived_bn_desc(call.bn_desc, call.x_desc, SPATIAL_PERSISTENT, shape, F16)
        assert fields(call, "scale bias") == pointers("weight bias")
        assert fields(call, "dscale dbias") == pointers("grad_weight grad_bias")
        assert call.epsilon == 1e-4
        saved = fields(call, "saved_mean saved_inv_variance")
        assert saved == pointers("running_mean running_var")
        assert (call.workspace, call.workspace_size) == (WORKSPACE, STUB_WORKSPACE)
        assert (call.reserve, call.reserve_size) == (POINTERS["reserve"], STUB_RESERVE)

        # The size queries got the same mode, ops, activation and descriptors.
        same = "handle mode bn_ops activation_desc x_desc y_desc dy_desc dz_desc dx_desc bn_desc"
        assert fields(query, same) == fields(call, same)
        same = "handle mode bn_ops activation_desc x_desc"
        assert fields(reserve, same) == fields(call, same)
    assert stub.live_activations.value == before  # destroyed with the operator descriptor


@pytest.mark.parametrize("fusion", FUSIONS)
def test_fused_backward_refuses_a_missing_or_small_reserve(stub, fusion):
    shape = FUSED_SHAPES[0]
    strides = channels_last(shape)
    with descriptor(shape, F16, F32, strides=strides, fusion=fusion, mode="saved_invstd") as desc:
        ptrs = fused_pointers(fusion)
        with pytest.raises(NullPointerError, match="reserve"):
            compute(desc, **ptrs | {"reserve": 0})
        with pytest.raises(InsufficientWorkspaceError, match="reserve_size"):
            compute(desc, **ptrs | {"reserve_size": STUB_RESERVE - 1})
        for name in ("output", "bias") + (("grad_z",) if fusion == "add_relu" else ()):
            with pytest.raises(NullPointerError, match=name):
                compute(desc, **ptrs | {name: 0})
    assert stub.backward.calls == 0


def test_rebuilding_a_fused_descriptor_destroys_its_activation(stub):
    shape = FUSED_SHAPES[0]
    gc.collect()
    before = stub.live_activations.value
    desc = descriptor(shape, F16, F32, strides=channels_last(shape), fusion="relu")
    desc.set_attributes(1e-3, "saved_invstd")
    assert stub.live_activations.value == before + 1
    desc.destroy()
    assert stub.live_activations.value == before


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("case", FUSED_ENGINES.values(), ids=list(FUSED_ENGINES))
def test_fused_backward_engine(stub, fusion, case):
    engine, shape, dtype, channel_dtype, layout, persistent = case
    engine = fused_engine(engine, fusion)
    gc.collect()
    live = (stub.live_tensors.value, stub.live_activations.value)
    strides = layout_strides(shape, layout)
    with descriptor(
        shape,
        dtype,
        channel_dtype,
        strides=strides,
        fusion=fusion,
        persistent=persistent,
        mode="saved_invstd",
    ) as desc:
        assert desc.engine == engine
        if engine == "cupy":  # no cuDNN object, no size query, and compute runs CuPy only
            assert (stub.live_tensors.value, stub.live_activations.value) == live
            with pytest.raises(AssertionError, match="CuPy stream scope"):
                compute(desc, **fused_pointers(fusion))
            assert nothing_recorded(stub)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_fused_backward_in_train_mode_runs_on_cupy(stub, fusion):
    """cuDNN's fused backward reads the forward's saved statistics; train mode has none."""
    shape = FUSED_SHAPES[0]
    strides = channels_last(shape)
    with descriptor(shape, F16, F32, strides=strides, fusion=fusion, mode="train") as desc:
        assert desc.engine == "cupy"


@pytest.mark.parametrize("fusion", [*FUSIONS, None])
def test_a_backward_without_a_reserve(stub, fusion):
    """cuDNN's fused backward reads the ReLU mask from the forward's reserve space: a fused
    problem that will get none (a batched backward) goes to the CuPy engine, which reads the
    mask from y; a plain one stays on cuDNN, which takes no reserve then."""
    shape = FUSED_SHAPES[0]
    strides = channels_last(shape)
    with descriptor(
        shape, F16, F32, strides=strides, fusion=fusion, mode="saved_invstd", reserve=False
    ) as desc:
        assert desc.engine == ("cudnn" if fusion is None else "cupy")
        assert desc.attributes.reserve is False


# --- the C API ------------------------------------------------------------------------------


def test_capi_hands_cudnn_the_same_arguments(stub):
    assert capi.infinirtSetDevice(Device.NVIDIA, 1) == Status.DEVICE_NOT_FOUND  # one device
    assert capi.infinirtSetDevice(Device.NVIDIA, 0) == Status.SUCCESS
    handle, desc, size = c_void_p(), c_void_p(), c_size_t()
    assert capi.infiniopCreateHandle(ctypes.byref(handle)) == Status.SUCCESS
    shape = (2, 3, 4, 5)
    descs = [capi_tensor(d) for d in tensors(shape, F16, F32, strides=channels_last(shape))]
    status = capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(desc), *descs)
    assert status == Status.SUCCESS, capi.last_error()
    assert capi.infiniopSetBatchNormBackwardAttributes(desc, 1e-3, 3) == Status.SUCCESS
    assert capi.infiniopGetBatchNormBackwardWorkspaceSize(desc, ctypes.byref(size)) == 0
    assert size.value == STUB_WORKSPACE

    ptrs = [c_void_p(POINTERS[name]) for name in BACKWARD_ORDER]
    args = (desc, c_void_p(WORKSPACE), size.value, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormBackward(*args) == Status.SUCCESS, capi.last_error()
    call = stub.backward
    assert call.calls == 1
    assert stub.set_stream.stream == STREAM
    # Channels-last, from saved statistics, but the C API's backward takes no reserve: SPATIAL.
    assert (call.mode, call.epsilon) == (SPATIAL, 1e-3)
    assert (call.reserve, call.reserve_size) == (0, 0)
    assert stub.tensor(call.x_desc) == (CUDNN_HALF, shape, channels_last(shape))
    assert fields(call, "x dy dx") == pointers("input grad_output grad_input")
    assert fields(call, "scale dscale dbias") == pointers("weight grad_weight grad_bias")
    assert fields(call, "saved_mean saved_inv_variance") == pointers("running_mean running_var")
    assert (call.workspace, call.workspace_size) == (WORKSPACE, STUB_WORKSPACE)

    # Refused before cuDNN: a small or misaligned workspace, a NULL input.
    small = (desc, c_void_p(WORKSPACE), size.value - 1, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormBackward(*small) == Status.INSUFFICIENT_WORKSPACE
    misaligned = (desc, c_void_p(WORKSPACE + 8), size.value, *ptrs, c_void_p(STREAM))
    assert capi.infiniopBatchNormBackward(*misaligned) == Status.BAD_PARAM
    assert "16-byte aligned" in capi.last_error()
    null_x = (*args[:6], None, *args[7:])
    assert capi.infiniopBatchNormBackward(*null_x) == Status.NULL_POINTER
    assert "input is NULL" in capi.last_error()
    assert call.calls == 1

    # A cuDNN failure: its status, strings and the repro, through last_error().
    stub.backward.status = 3003
    assert capi.infiniopBatchNormBackward(*args) == Status.BAD_TENSOR_DTYPE
    assert "STUB_STATUS_3003" in capi.last_error() and "To reproduce" in capi.last_error()

    assert capi.infiniopDestroyBatchNormBackwardDescriptor(desc) == Status.SUCCESS
    assert capi.infiniopDestroyBatchNormBackwardDescriptor(desc) == Status.BAD_PARAM
    for d in descs:
        assert capi.infiniopDestroyTensorDescriptor(d) == Status.SUCCESS
    assert capi.infiniopDestroyHandle(handle) == Status.SUCCESS
