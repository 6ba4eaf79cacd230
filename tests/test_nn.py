"""``cudnn_bn.nn.BatchNorm`` against PyTorch's own ``torch.nn.BatchNorm1d/2d/3d`` in float64.

Each scenario runs the same steps through both: several training steps, then eval steps,
with fresh data each step. After every step it compares the output, ``grad_input`` (and
``grad_z``), the accumulated weight/bias gradients, the running statistics and
``num_batches_tracked``. The torch module is float64 on the values the layer saw (rounded to
its dtype), so the tolerance is the rounding of the layer's dtype: 1e-10 for float64,
InfiniCore's 2e-5 for float32 and 1e-2 for F16/BF16 (whose outputs alone are rounded to
2^-11 and 2^-8 relative), each as atol + rtol.
"""

import copy
import itertools
import pickle
import re
import socket
import threading
import warnings
from collections import OrderedDict

import ml_dtypes
import numpy as np
import pytest
import torch

from cudnn_bn import InfiniError, Status
from cudnn_bn.nn import BatchNorm, SyncBatchNorm
from cudnn_bn.nn.batch_norm import state_version

EPS = 1e-5
MODULES = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}
MODULES[5] = torch.nn.BatchNorm3d
SHAPES = [(8, 3), (4, 3, 5), (3, 3, 4, 5), (2, 3, 2, 3, 4)]
TOLERANCE = {"f64": 1e-10, "f32": 2e-5, "f16": 1e-2, "bf16": 1e-2}
DTYPES = {
    "numpy": {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16},
    "torch": {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16},
}
DTYPES["torch"]["bf16"] = torch.bfloat16


def host(array) -> np.ndarray:
    """A float64 NumPy copy of a NumPy or CuPy array or a torch tensor."""
    if isinstance(array, torch.Tensor):
        return array.detach().to("cpu", torch.float64).numpy()
    if type(array).__module__.startswith("cupy"):
        return array.get().astype(np.float64)
    return np.asarray(array, dtype=np.float64)


def make(values: np.ndarray, lib: str, dtype: str, channels_last: bool = False):
    """``values`` as a ``lib`` array of ``dtype``, optionally with the channels innermost:
    ``lib`` is ``"numpy"``, ``"torch"`` (CPU), ``"cupy"`` or ``"cuda"`` (torch on a GPU)."""
    if lib in ("numpy", "cupy"):
        xp = np if lib == "numpy" else pytest.importorskip("cupy")
        array = xp.asarray(values.astype(DTYPES["numpy"][dtype]))
        if channels_last:
            array = xp.moveaxis(xp.ascontiguousarray(xp.moveaxis(array, 1, -1)), -1, 1)
        return array
    tensor = torch.tensor(values).to(DTYPES["torch"][dtype])
    if lib == "cuda":
        tensor = tensor.cuda()
    if channels_last:
        tensor = tensor.movedim(1, -1).contiguous().movedim(-1, 1)
    return tensor


def close(what: str, actual, expected, tol: float) -> None:
    actual, expected = host(actual), host(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    error = np.abs(actual - expected)
    assert np.all(error <= tol * (1 + np.abs(expected))), f"{what}: max error {error.max()}"


def torch_module(shape, **flags) -> torch.nn.Module:
    """torch's module for ``shape`` in float64 with random weight/bias (when affine)."""
    module = MODULES[len(shape)](shape[1], eps=EPS, **flags).double()
    if module.affine:
        rng = np.random.default_rng(42)
        with torch.no_grad():
            module.weight.copy_(torch.tensor(rng.uniform(0.5, 1.5, shape[1])))
            if module.bias is not None:
                module.bias.copy_(torch.tensor(rng.standard_normal(shape[1]) * 0.5))
    return module


def numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: value.detach().numpy().copy() for name, value in module.state_dict().items()}


def torch_step(module, x, dy, z, fusion):
    """torch's ``relu(bn(x) [+ z])`` (or ``bn(x)``) and its gradients by name."""
    xt = torch.tensor(x, requires_grad=True)
    zt = None if z is None else torch.tensor(z, requires_grad=True)
    y = module(xt)
    if fusion is not None:
        y = torch.relu(y + zt if zt is not None else y)
    y.backward(torch.tensor(dy))
    grads = {"grad_input": xt.grad, "grad_z": None if zt is None else zt.grad}
    return y.detach(), grads


def compare_state(layer: BatchNorm, module: torch.nn.Module, tol: float, step: int) -> None:
    """The gradients of the parameters torch has, the state dict (names, order, values) and
    which arrays are None."""
    for name in ("weight", "bias"):
        grad = getattr(module, name) is not None and getattr(module, name).grad
        if grad is None or grad is False:
            assert getattr(layer, f"{name}_grad") is None, (step, name)
        else:
            close(f"step {step}: {name}_grad", getattr(layer, f"{name}_grad"), grad, tol)
    want, got = module.state_dict(), layer.state_dict()
    assert list(got) == list(want), step
    for name, value in want.items():
        close(f"step {step}: {name}", got[name], value, tol)
    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        assert (getattr(layer, name) is None) == (getattr(module, name) is None), (step, name)
    if module.num_batches_tracked is not None:
        assert layer.num_batches_tracked == int(module.num_batches_tracked), step


def run_scenario(
    shape,
    *,
    lib="numpy",
    dtype="f64",
    fusion=None,
    channels_last=False,
    modes=(True, True, True, False, False, True),
    seed=0,
    change=None,
    **flags,
) -> BatchNorm:
    """Train/eval steps (``modes``: True trains) through both; compares after every step.
    ``change``: (step, function) applied to the torch module and the layer before that step."""
    module = torch_module(shape, **flags)
    layer = BatchNorm(shape[1], EPS, fusion=fusion, **flags)
    layer.load_state_dict(numpy_state(module))
    tol = TOLERANCE[dtype]
    rng = np.random.default_rng(seed)
    for step, training in enumerate(modes):
        if change is not None and change[0] == step:
            change[1](module)
            change[1](layer)
        module.train(training)
        layer.train(training)
        x = rng.standard_normal(shape) * 2 + np.arange(shape[1]).reshape(
            -1, *[1] * (len(shape) - 2)
        )
        dy = rng.standard_normal(shape)
        z = rng.standard_normal(shape) if fusion == "add_relu" else None
        arrays = [make(a, lib, dtype, channels_last) for a in (x, dy, z) if a is not None]
        x, dy, *z = [host(a) for a in arrays]  # the values the layer sees
        expected, grads = torch_step(module, x, dy, z[0] if z else None, fusion)
        output = layer(arrays[0], *arrays[2:])
        got = layer.backward(arrays[1])
        if fusion == "add_relu":
            got, grad_z = got
            close(f"step {step}: grad_z", grad_z, grads["grad_z"], tol)
            assert type(grad_z) is type(arrays[0])
        assert type(output) is type(got) is type(arrays[0])
        close(f"step {step}: output", output, expected, tol)
        close(f"step {step}: grad_input", got, grads["grad_input"], tol)
        compare_state(layer, module, tol, step)
    return layer


FLAGS = [
    dict(momentum=momentum, affine=affine, track_running_stats=track)
    for momentum, affine, track in itertools.product((0.1, None), (True, False), (True, False))
]


def flag_id(flags: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in flags.items())


@pytest.mark.parametrize("flags", FLAGS, ids=flag_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
def test_every_flag_combination_matches_torch_in_float64(shape, flags):
    run_scenario(shape, **flags)


@pytest.mark.parametrize("flags", FLAGS, ids=flag_id)
@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
def test_fused_layers_match_torch_relu_of_bn(fusion, flags):
    run_scenario((4, 3, 5), fusion=fusion, **flags)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("fusion", [None, "add_relu"])
def test_narrow_dtypes_keep_float32_state_and_match_torch(lib, dtype, fusion):
    layer = run_scenario((4, 3, 2, 5), lib=lib, dtype=dtype, fusion=fusion)
    wanted = np.float32 if lib == "numpy" else torch.float32
    for array in (layer.weight, layer.bias, layer.running_mean, layer.running_var):
        assert array.dtype == wanted and type(array) is type(layer.weight_grad)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("shape", SHAPES[2:], ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("fusion", [None, "relu"])
def test_channels_last_input_matches_torch(lib, shape, fusion):
    run_scenario(shape, lib=lib, dtype="f32", fusion=fusion, channels_last=True)


def test_torch_tensors_keep_state_as_tensors():
    layer = run_scenario((4, 3, 5), lib="torch", momentum=None)
    assert all(isinstance(a, torch.Tensor) for a in layer.state_dict().values())
    assert layer.state_dict()["num_batches_tracked"].dtype == torch.int64


def no_running_statistics(module) -> None:
    module.running_mean = module.running_var = None


@pytest.mark.parametrize("step", [0, 2], ids=["before-any-forward", "after-training"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_set_to_none_are_gone_as_torch_s(step, momentum):
    """torch's ``m.running_mean = m.running_var = None``: the batch's statistics in eval too,
    still counted in ``num_batches_tracked``, neither in the state dict. The layer's eval
    forward raised NULL_POINTER "running_mean is None", its ``state_dict()`` BAD_PARAM, and
    set before the first forward, that forward made them anew."""
    run_scenario((4, 3, 5), momentum=momentum, change=(step, no_running_statistics))


def test_track_running_stats_turned_off_later_keeps_the_running_statistics_for_eval():
    """torch decides by the buffers, not the flag: ``track_running_stats = False`` on a
    trained module stops the updates and the count, and eval still uses the running
    statistics. The layer's eval used the batch's."""
    run_scenario(
        (4, 3, 5), modes=(True, True, False, True, False),
        change=(2, lambda m: setattr(m, "track_running_stats", False)),
    )  # fmt: skip


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", ["running_mean", "running_var"])
def test_one_running_statistic_none_raises_as_torch(name, training):
    """torch refuses one running statistic without the other (ValueError in training,
    RuntimeError in eval); the layer updated the other alone in training (NULL_POINTER in
    eval). Now BAD_PARAM (a ValueError), nothing changed."""
    module = torch.nn.BatchNorm1d(3).double().train(training)
    layer = BatchNorm(3).train(training)
    x = np.random.default_rng(12).standard_normal((4, 3))
    layer(x)
    before = {n: np.array(v) for n, v in layer.state_dict().items()}
    for m in (module, layer):
        setattr(m, name, None)
    with pytest.raises((ValueError, RuntimeError)):
        module(torch.tensor(x))
    with pytest.raises(ValueError) as info:
        layer(x)
    assert info.value.status == Status.BAD_PARAM and "running_mean and running_var" in str(
        info.value
    )
    for n, value in layer.state_dict().items():
        np.testing.assert_array_equal(value, before[n])


@pytest.mark.parametrize("step", [0, 2], ids=["before-any-forward", "after-training"])
@pytest.mark.parametrize("names", [("weight",), ("bias",), ("weight", "bias")])
def test_parameters_set_to_none_are_gone_as_torch_s(names, step):
    """torch's ``m.weight = None`` (or ``bias``): 1 (or 0) in its place, no gradient, not in
    the state dict. The layer accumulated a ``bias_grad`` without a bias and ``weight_grad +=
    None`` raised INTERNAL_ERROR; set before the first forward, the first forward made them.
    (The gradients are zeroed with the change: torch's go with its parameters.)"""

    def change(m):
        m.zero_grad()
        for name in names:
            setattr(m, name, None)

    run_scenario((4, 3, 5), fusion="relu", change=(step, change))


def test_bias_false_is_torch_s_weight_alone():
    """torch 2.13's ``bias=False``: an affine layer with a weight and no bias (a TypeError
    here before)."""
    run_scenario((4, 3, 5), bias=False)
    layer = BatchNorm(3, bias=False)
    assert repr(layer) == repr(torch.nn.BatchNorm1d(3, bias=False)).replace("1d", "", 1)


@pytest.mark.parametrize(
    "flags", [{}, dict(momentum=None, affine=False, track_running_stats=False, eps=0.5)]
)
def test_repr_is_torch_s(flags):
    """``BatchNorm1d(3, eps=1e-05, momentum=0.1, affine=True, bias=True, ...)`` as torch's
    (``extra_repr`` too), ``fusion`` only when fused; the layer's had no ``bias`` and always a
    ``fusion``."""
    want = torch.nn.BatchNorm1d(3, **flags)
    assert repr(BatchNorm(3, **flags)) == repr(want).replace("BatchNorm1d", "BatchNorm")
    assert BatchNorm(3, **flags).extra_repr() == want.extra_repr()
    assert repr(BatchNorm(3, fusion="relu")).endswith("track_running_stats=True, fusion='relu')")


# --- state dicts ---------------------------------------------------------------------------------


def trained_module(shape=(6, 3, 4)) -> torch.nn.Module:
    """A torch module after three training steps (non-trivial running statistics)."""
    module = torch_module(shape)
    rng = np.random.default_rng(5)
    for _ in range(3):
        module(torch.tensor(rng.standard_normal(shape) * 3 + 1))
    return module


@pytest.mark.parametrize("before_first_forward", [True, False])
def test_torch_state_loads_and_results_match_torch(before_first_forward):
    module = trained_module()
    layer = BatchNorm(3)
    if not before_first_forward:
        layer(np.ones((2, 3, 4)))  # the arrays exist: the state is copied into them
        kept = layer.running_var
    layer.load_state_dict(numpy_state(module))
    if not before_first_forward:
        assert layer.running_var is kept
    assert layer.num_batches_tracked == 3
    x = np.random.default_rng(6).standard_normal((6, 3, 4))
    for training in (False, True):
        module.train(training)
        layer.train(training)
        close("output", layer(x), module(torch.tensor(x)), 1e-12)
        compare_state(layer, module, 1e-12, 0)


def test_layer_state_loads_into_torch_and_results_match():
    layer = BatchNorm(3)
    rng = np.random.default_rng(7)
    for _ in range(4):
        layer(rng.standard_normal((5, 3, 2)) * 2)
        layer.backward(rng.standard_normal((5, 3, 2)))
    layer.weight -= 0.1 * layer.weight_grad
    state = layer.state_dict()
    assert list(state) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    module = torch.nn.BatchNorm1d(3).double()
    module.load_state_dict({name: torch.as_tensor(value) for name, value in state.items()})
    module.eval()
    layer.eval()
    x = rng.standard_normal((5, 3, 2))
    close("output", layer(x), module(torch.tensor(x)), 1e-12)
    assert int(module.num_batches_tracked) == 4


def test_state_dict_before_any_forward_is_torch_initial_state():
    state = BatchNorm(4).state_dict()
    for name, value in torch.nn.BatchNorm1d(4).state_dict().items():
        np.testing.assert_array_equal(np.asarray(state[name]), value.numpy())


@pytest.mark.parametrize(
    ("change", "status"),
    [
        (lambda s: s.pop("running_var"), Status.BAD_PARAM),
        (lambda s: s.update(extra=np.zeros(3)), Status.BAD_PARAM),
        (lambda s: s.update(bias=np.zeros(4)), Status.BAD_TENSOR_SHAPE),
        (lambda s: s.update(num_batches_tracked=np.array(-1)), Status.BAD_PARAM),
        # A count torch's int64 cannot hold: INTERNAL_ERROR (OverflowError) for inf, and 2**63
        # was taken, after which state_dict() failed so (found by an outsider's attack).
        (lambda s: s.update(num_batches_tracked=np.array(np.inf)), Status.BAD_PARAM),
        (lambda s: s.update(num_batches_tracked=torch.tensor(float("inf"))), Status.BAD_PARAM),
        (lambda s: s.update(num_batches_tracked=np.array(2.0**63)), Status.BAD_PARAM),
        # Complex values: their imaginary parts were dropped with a ComplexWarning (under
        # -W error: INTERNAL_ERROR "unexpected ComplexWarning").
        (lambda s: s.update(weight=np.ones(3, complex)), Status.BAD_PARAM),
        (lambda s: s.update(running_mean=torch.ones(3, dtype=torch.complex64)), Status.BAD_PARAM),
        # Values that are not numbers, which torch's load refuses: NumPy read [None] * 3 as
        # NaNs and strings as the numbers they spell, and the layer loaded them.
        (lambda s: s.update(weight=[None] * 3), Status.BAD_PARAM),
        (lambda s: s.update(running_var=np.array(["1", "2", "3"])), Status.BAD_PARAM),
        (lambda s: s.update(num_batches_tracked="7"), Status.BAD_PARAM),
        # Tensors torch cannot copy to host values (a RuntimeError from torch): INTERNAL_ERROR.
        (lambda s: s.update(weight=torch.ones(3, device="meta")), Status.BAD_PARAM),
        (
            lambda s: s.update(bias=torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)),
            Status.BAD_PARAM,
        ),
        (
            lambda s: s.update(running_mean=torch.nested.as_nested_tensor([torch.ones(3)])),
            Status.BAD_PARAM,
        ),
        # A masked array: its masked values were loaded (the array API refuses masks).
        (lambda s: s.update(weight=np.ma.masked_array(np.ones(3), [0, 1, 0])), Status.BAD_PARAM),
    ],
)
def test_bad_state_raises_and_changes_nothing(change, status):
    layer = BatchNorm(3)
    layer(np.arange(12.0).reshape(4, 3))
    before = {n: np.array(v) for n, v in layer.state_dict().items()}
    state = numpy_state(trained_module())
    change(state)
    with pytest.raises(InfiniError) as info:
        layer.load_state_dict(state)
    assert info.value.status == status
    for name, value in layer.state_dict().items():
        np.testing.assert_array_equal(np.asarray(value), before[name])


def _inference_tensor(array: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return array.clone()


@pytest.mark.parametrize(
    "made",
    [
        torch.nn.Parameter,  # a torch optimizer's parameter
        _inference_tensor,
    ],
    ids=["Parameter", "inference_mode"],
)
def test_torch_arrays_of_any_autograd_state_load_as_the_forward_writes_them(made):
    """A layer's tensors set to a ``Parameter`` or an inference tensor, which the forward
    reads and moves through their pointers: ``load_state_dict`` (``reset_parameters()``
    too) wrote weight with ``[...] =`` then hit torch's refusal (a leaf that requires grad,
    an inference tensor outside inference mode), INTERNAL_ERROR with half the state loaded.
    The forward moves a running_var that requires grad only where grad mode is off, as
    torch's own batch norm."""
    layer = BatchNorm(3, like=torch.zeros(1, dtype=torch.float64))
    layer.bias, layer.running_var = made(layer.bias), made(layer.running_var)
    with torch.no_grad():
        layer(torch.arange(12.0, dtype=torch.float64).reshape(4, 3))
    module = trained_module()
    layer.load_state_dict(module.state_dict())
    compare_state(layer, module, 0, 0)
    layer.reset_parameters()
    compare_state(layer, torch.nn.BatchNorm1d(3).double(), 0, 0)


def test_an_unwritable_array_of_the_layer_is_refused_before_any_is_loaded():
    """A read-only running_var (which the forward refuses, BAD_PARAM): load_state_dict wrote
    weight, bias and running_mean, then raised INTERNAL_ERROR (NumPy's ValueError)."""
    layer = BatchNorm(3)
    layer(np.arange(12.0).reshape(4, 3))
    layer.running_var.flags.writeable = False
    before = {n: np.array(v) for n, v in layer.state_dict().items()}
    with pytest.raises(InfiniError, match="running_var is read-only") as info:
        layer.load_state_dict(numpy_state(trained_module()))
    assert info.value.status == Status.BAD_PARAM
    for name, value in layer.state_dict().items():
        np.testing.assert_array_equal(np.asarray(value), before[name])


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("count", [2**53 + 1, 2**63 - 2])
def test_num_batches_tracked_round_trips_torch_s_int64_exactly(count, lib):
    """torch's ``num_batches_tracked`` is an int64: the layer read it through float64, so
    2**53 + 1 loaded as 2**53 and 2**63 - 2 was refused as 2**63. Now read exactly, it comes
    back in the layer's ``state_dict()`` and into torch as it was; ``momentum=None`` then
    moves the running statistics by torch's ``1 / float(num_batches_tracked)``."""
    module = torch.nn.BatchNorm1d(3, momentum=None).double()
    module.num_batches_tracked.fill_(count)
    state = module.state_dict()
    layer = BatchNorm(3, momentum=None)
    layer.load_state_dict(numpy_state(module) if lib == "numpy" else state)
    assert layer.num_batches_tracked == count
    x = np.random.default_rng(13).standard_normal((4, 3))
    close("output", layer(x), module(torch.tensor(x)), 1e-12)
    compare_state(layer, module, 1e-12, 0)
    back = torch.nn.BatchNorm1d(3).double()
    back.load_state_dict({n: torch.as_tensor(v) for n, v in layer.state_dict().items()})
    assert int(back.num_batches_tracked) == count + 1


def with_metadata() -> OrderedDict:
    """A destination as torch makes its own: an ``OrderedDict`` with a ``_metadata``."""
    destination = OrderedDict()
    destination._metadata = OrderedDict()
    return destination


@pytest.mark.parametrize("destination", [None, dict, with_metadata])
def test_state_dict_takes_torch_s_prefix_destination_and_keep_vars(destination):
    """torch's ``state_dict(destination=, prefix=, keep_vars=)`` (how a container gathers
    its children's states), with its ``_metadata`` version where the destination has one
    (which the layer's own load then reads); the layer's took no argument (TypeError)."""
    states = []
    for module in (BatchNorm(3), torch.nn.BatchNorm1d(3)):
        kwargs = dict(prefix="bn1.", keep_vars=True)
        if destination is not None:
            kwargs["destination"] = destination()
        states.append(module.state_dict(**kwargs))
        assert destination is None or states[-1] is kwargs["destination"]
    got, want = states
    assert list(got) == list(want) and type(got) is type(want)
    assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None)
    assert state_version(BatchNorm(3).state_dict()) == 2


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.int64, np.bool_])
def test_a_state_of_other_real_dtypes_loads(dtype):
    state = {name: value.astype(dtype) for name, value in numpy_state(trained_module()).items()}
    layer = BatchNorm(3)
    layer.load_state_dict(state)
    for name, value in layer.state_dict().items():
        np.testing.assert_array_equal(value, state[name].astype(np.float64))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_state_beyond_float32_loads_as_infinities_without_a_warning(lib):
    """float64 values beyond float32 load into a float32 layer as inf, as torch's
    ``load_state_dict`` copies them, without NumPy's overflow warning (which ``python -W
    error`` made INTERNAL_ERROR "unexpected RuntimeWarning"; found by an outsider's attack)."""
    x = np.ones((4, 3), np.float32)
    layer = BatchNorm(3)
    layer(x if lib == "numpy" else torch.from_numpy(x))
    state = numpy_state(trained_module())
    state["running_var"][:] = 1e300
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(state)
    assert np.isinf(np.asarray(layer.running_var)).all()


def test_a_state_without_num_batches_tracked_loads_strictly_and_keeps_the_count():
    """As torch's ``_load_from_state_dict`` for a state of no version (a plain dict, or a
    checkpoint from before its version 2): a missing ``num_batches_tracked`` keeps the count,
    where a strict load raised BAD_PARAM "missing ['num_batches_tracked']"."""
    state = numpy_state(trained_module())
    del state["num_batches_tracked"]
    x = np.random.default_rng(8).standard_normal((6, 3, 4))
    module, layer = torch_module((6, 3, 4)), BatchNorm(3)
    module(torch.tensor(x))
    layer(x)
    module.load_state_dict({name: torch.tensor(value) for name, value in state.items()})
    layer.load_state_dict(state)
    compare_state(layer, module, 1e-12, 0)


@pytest.mark.parametrize("flags", FLAGS[:4], ids=flag_id)
def test_a_torch_state_of_other_flags_gives_torch_s_missing_and_unexpected_keys(flags):
    """A torch module's own ``state_dict()`` says it is of version 2, so torch counts a
    missing ``num_batches_tracked`` (its strict load raises): the layer's load counted it as
    a plain dict's, kept."""
    other = {name: not value for name, value in flags.items() if name != "momentum"}
    state = torch.nn.BatchNorm1d(3, **other).state_dict()
    got = BatchNorm(3, **flags).load_state_dict(state, strict=False)
    want = torch.nn.BatchNorm1d(3, **flags).load_state_dict(state, strict=False)
    assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys)
    state = torch.nn.BatchNorm1d(3).state_dict()
    del state["num_batches_tracked"]
    for module in (BatchNorm(3), torch.nn.BatchNorm1d(3)):
        with pytest.raises((InfiniError, RuntimeError), match="num_batches_tracked"):
            module.load_state_dict(state)


@pytest.mark.parametrize("after_a_forward", [False, True])
@pytest.mark.parametrize("reset", ["reset_running_stats", "reset_parameters"])
def test_resets_are_torch_s_in_place(reset, after_a_forward):
    """torch's ``reset_running_stats`` (running_mean 0, running_var 1, count 0) and
    ``reset_parameters`` (those, weight 1 and bias 0), on the layer's own arrays; the layer
    had neither (AttributeError)."""
    module, layer = trained_module(), BatchNorm(3)
    layer.load_state_dict(numpy_state(module))
    if after_a_forward:
        layer(np.ones((2, 3, 4)))
        module(torch.ones(2, 3, 4, dtype=torch.float64))
    kept = layer.running_var
    getattr(layer, reset)()
    getattr(module, reset)()
    assert layer.running_var is kept
    for name, value in module.state_dict().items():
        np.testing.assert_array_equal(np.asarray(layer.state_dict()[name]), value.numpy())


def test_non_strict_load_takes_what_is_there_and_returns_torch_s_keys():
    """The load returns torch's ``(missing_keys, unexpected_keys)`` (it returned None)."""
    state = {"running_mean": np.full(3, 2.0), "other": np.ones(1)}
    layer = BatchNorm(3)
    got = layer.load_state_dict(state, strict=False)
    np.testing.assert_array_equal(layer.state_dict()["running_mean"], np.full(3, 2.0))
    module = torch.nn.BatchNorm1d(3)
    want = module.load_state_dict({n: torch.tensor(v) for n, v in state.items()}, strict=False)
    assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys)
    assert tuple(layer.load_state_dict(numpy_state(module))) == ([], [])


# --- batches torch treats specially ------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1), (1, 3, 1, 1)])
def test_one_value_per_channel_raises_where_torch_does(shape, training):
    """torch raises ValueError when it would normalize with the batch's statistics (training,
    or eval without running statistics); the layer raises BAD_TENSOR_SHAPE (a ValueError)
    and, unlike torch, leaves num_batches_tracked alone."""
    for track in (True, False):
        module = MODULES[len(shape)](3, track_running_stats=track).double().train(training)
        layer = BatchNorm(3, track_running_stats=track).train(training)
        x = np.ones(shape)
        try:
            module(torch.tensor(x))
        except ValueError:
            with pytest.raises(ValueError) as info:
                layer(x)
            assert info.value.status == Status.BAD_TENSOR_SHAPE
            assert layer.num_batches_tracked in (0, None)
        else:
            close("output", layer(x), module(torch.tensor(x)), 1e-12)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("track", [True, False])
def test_eps_zero_raises_where_torch_does(track, training):
    """torch refuses ``eps=0`` where it normalizes with the batch's statistics (training, or
    eval without running statistics): ValueError "eps must be positive during training"; the
    layer took it (NaN outputs for a constant channel). Now BAD_PARAM (a ValueError) that
    changes nothing; eval with running statistics takes it, as torch."""
    module = torch.nn.BatchNorm1d(3, eps=0.0, track_running_stats=track).double()
    layer = BatchNorm(3, eps=0.0, track_running_stats=track).train(training)
    x = np.random.default_rng(9).standard_normal((4, 3))
    try:
        expected = module.train(training)(torch.tensor(x))
    except ValueError:
        with pytest.raises(ValueError) as info:
            layer(x)
        assert info.value.status == Status.BAD_PARAM and "eps" in str(info.value)
        assert layer.weight is None and layer.num_batches_tracked in (0, None)
    else:
        close("output", layer(x), expected, 1e-12)


@pytest.mark.parametrize("flags", FLAGS, ids=flag_id)
def test_empty_batch_gives_empty_output_and_leaves_statistics_alone(flags):
    """N = 0 in training: an empty output, running statistics unchanged; torch still counts
    the batch in num_batches_tracked, and so does the layer (momentum=None depends on it)."""
    modes = (True, False, True, True)
    module = torch_module((0, 3, 2), **flags)
    layer = BatchNorm(3, EPS, **flags)
    layer.load_state_dict(numpy_state(module))
    for step, training in enumerate(modes):
        module.train(training)
        layer.train(training)
        shape = (0, 3, 2) if step < 2 else (4, 3, 2)
        x = np.random.default_rng(step).standard_normal(shape)
        dy = np.ones(shape)
        expected, grads = torch_step(module, x, dy, None, None)
        close("output", layer(x), expected, 1e-10)
        close("grad_input", layer.backward(dy), grads["grad_input"], 1e-10)
        compare_state(layer, module, 1e-10, step)


# --- the rest of the interface -----------------------------------------------------------------


def test_zero_grad_forgets_and_a_backward_needs_its_forward():
    layer = BatchNorm(3)
    with pytest.raises(InfiniError) as info:
        layer.backward(np.ones((4, 3)))
    assert info.value.status == Status.BAD_PARAM and "forward" in str(info.value)
    x = np.random.default_rng(0).standard_normal((4, 3))
    layer(x)
    first = np.array(layer.backward(np.ones((4, 3))))
    with pytest.raises(InfiniError):
        layer.backward(np.ones((4, 3)))  # one backward per forward
    layer.zero_grad()
    assert layer.weight_grad is None and layer.bias_grad is None
    layer(x)
    np.testing.assert_array_equal(layer.backward(np.ones((4, 3))), first)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_layer_pickles_and_copies_after_a_forward(lib):
    """As torch's modules (``torch.save(model)``, ``copy.deepcopy`` for an EMA copy): the
    copy has the state and no pending backward; pickling raised AttributeError "Can't pickle
    local object" (the backward's closure), and a deep copy's backward read the original's
    arrays."""
    rng = np.random.default_rng(10)
    x, dy = (make(rng.standard_normal((4, 3, 2)), lib, "f32") for _ in range(2))
    layer = BatchNorm(3, momentum=None)
    layer(x)
    for copy_of in (lambda layer: pickle.loads(pickle.dumps(layer)), copy.deepcopy):
        copy_ = copy_of(layer)
        with pytest.raises(InfiniError):
            copy_.backward(dy)
        for name, value in layer.state_dict().items():
            np.testing.assert_array_equal(host(copy_.state_dict()[name]), host(value))
        np.testing.assert_array_equal(host(copy_(x)), host(layer(x)))
        np.testing.assert_array_equal(host(copy_.backward(dy)), host(layer.backward(dy)))


def test_zero_grad_takes_torch_s_set_to_none():
    """``zero_grad(set_to_none=False)`` zeroes the gradients in place, as torch's (a
    TypeError before: the layer took no argument)."""
    layer = BatchNorm(3)
    layer.zero_grad(set_to_none=False)  # no gradients yet: they stay None
    assert layer.weight_grad is None
    layer(np.random.default_rng(0).standard_normal((4, 3)))
    layer.backward(np.ones((4, 3)))
    kept = layer.weight_grad
    layer.zero_grad(set_to_none=False)
    assert layer.weight_grad is kept and not kept.any() and not layer.bias_grad.any()


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


@pytest.mark.parametrize(
    ("bias_grad", "status"),
    [
        (np.zeros(5, np.float32), Status.BAD_PARAM),
        (np.zeros(3, np.int64), Status.BAD_TENSOR_DTYPE),
        (_read_only(np.zeros(3, np.float32)), Status.BAD_PARAM),
        (torch.zeros(3), Status.BAD_PARAM),
        ([0.0, 0.0, 0.0], Status.BAD_PARAM),
    ],
    ids=["shape", "integers", "read-only", "torch", "list"],
)
def test_a_gradient_that_cannot_take_the_sum_raises_and_changes_nothing(bias_grad, status):
    """A ``bias_grad`` the caller set that the backward cannot add to in place (another shape
    or library, integers, read-only, no array) is that status naming it, and the backward
    changes nothing: ``weight_grad`` not added to, the backward still pending (before: an
    INTERNAL_ERROR of NumPy's ``+=`` after ``weight_grad`` had been added to, the backward
    gone; a list was extended). One of another float dtype takes the sum, as ``+=`` does; a
    torch gradient that requires grad itself too, as ``load_state_dict`` writes one."""
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((4, 3, 5)).astype(np.float32) for _ in range(2))
    layer = BatchNorm(3)
    layer(x)
    layer.backward(dy)
    kept = layer.weight_grad.copy()
    layer.bias_grad = bias_grad
    layer(x)
    with pytest.raises(InfiniError, match="bias_grad") as info:
        layer.backward(dy)
    assert info.value.status == status
    np.testing.assert_array_equal(layer.weight_grad, kept)
    assert layer.bias_grad is bias_grad
    layer.bias_grad = None
    layer.backward(dy)  # the pending backward
    np.testing.assert_array_equal(layer.weight_grad, 2 * kept)
    layer.bias_grad = wide = np.zeros(3)
    layer(x)
    layer.backward(dy)
    assert layer.bias_grad is wide and wide.any()
    tensors = BatchNorm(3)
    tensors(torch.from_numpy(x))
    tensors.bias_grad = total = torch.zeros(3, requires_grad=True)
    tensors.backward(torch.from_numpy(dy))
    assert tensors.bias_grad is total
    torch.testing.assert_close(total.detach(), torch.from_numpy(dy).sum((0, 2)))


@pytest.mark.parametrize(
    "bias_grad", [_read_only(np.ones(3)), [1.0, 2.0, 3.0]], ids=["read-only", "list"]
)
def test_zero_grad_of_a_gradient_it_cannot_zero_raises_and_changes_nothing(bias_grad):
    """``zero_grad(set_to_none=False)`` with a ``bias_grad`` it cannot zero in place is a
    BAD_PARAM naming it, ``weight_grad`` left as it was (before: NumPy's ValueError, or a
    list's TypeError, escaped, after ``weight_grad`` had been zeroed); a torch gradient that
    requires grad is zeroed, as torch's ``zero_grad`` zeroes it."""
    layer = BatchNorm(3)
    layer(np.random.default_rng(0).standard_normal((4, 3)))
    layer.backward(np.ones((4, 3)))
    kept = layer.weight_grad.copy()
    layer.bias_grad = bias_grad
    with pytest.raises(InfiniError, match="bias_grad") as info:
        layer.zero_grad(set_to_none=False)
    assert info.value.status == Status.BAD_PARAM
    np.testing.assert_array_equal(layer.weight_grad, kept)
    tensors = BatchNorm(3)
    tensors(torch.randn(4, 3))
    tensors.bias_grad = total = torch.ones(3, requires_grad=True)
    tensors.zero_grad(set_to_none=False)
    assert tensors.bias_grad is total and not total.any()


def test_an_array_assigned_before_the_first_forward_is_not_dropped():
    """Before the first forward the layer's arrays do not exist (None): one assigned then (a
    zero-initialized weight) was replaced by the first forward's new arrays, silently. Now
    that forward raises BAD_PARAM naming it and pointing to ``like=``/``load_state_dict``."""
    layer = BatchNorm(3)
    layer.weight = np.zeros(3, np.float32)
    with pytest.raises(InfiniError) as info:
        layer(np.ones((4, 3), np.float32))
    assert info.value.status == Status.BAD_PARAM and "weight" in str(info.value)
    assert layer.num_batches_tracked == 0 and layer.running_mean is None


def test_like_makes_the_state_at_once_in_that_library():
    layer = BatchNorm(3, like=torch.zeros(0, dtype=torch.float16))
    assert layer.weight.dtype == torch.float32 and layer.running_var.tolist() == [1.0] * 3
    with pytest.raises(InfiniError) as info:
        layer(np.ones((4, 3), np.float32))
    assert info.value.status == Status.BAD_PARAM and "torch" in str(info.value)
    assert layer.num_batches_tracked == 0


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(num_features=0), "num_features"),
        (dict(num_features=3.0), "num_features"),
        (dict(num_features=2**70), "num_features"),  # INTERNAL_ERROR from NumPy before
        (dict(num_features=3, eps=-1.0), "eps"),
        (dict(num_features=3, momentum=2.0), "momentum"),
        (dict(num_features=3, fusion="gelu"), "fusion"),
        (dict(num_features=3, like=[1.0]), "like"),
    ],
)
def test_bad_arguments_raise_bad_param(kwargs, words):
    with pytest.raises(InfiniError) as info:
        BatchNorm(**kwargs)
    assert info.value.status == Status.BAD_PARAM and words in str(info.value)


def test_train_takes_a_bool_and_load_state_dict_a_mapping():
    """As torch's ``Module.train`` (which refuses a mode that is not a bool) and
    ``load_state_dict``: ``train("yes")`` switched to training mode, and ``load_state_dict(None)``
    was INTERNAL_ERROR "unexpected TypeError" (found by an outsider's attack)."""
    layer = BatchNorm(3).eval()
    for call in (lambda: layer.train("yes"), lambda: layer.load_state_dict(None)):
        with pytest.raises(InfiniError) as info:
            call()
        assert info.value.status == Status.BAD_PARAM
    assert not layer.training
    assert layer.train(True) is layer and layer.training


def test_bad_input_raises_infini_error_and_changes_nothing():
    layer = BatchNorm(3, fusion="add_relu")
    x = np.ones((4, 3))
    for call in (
        lambda: layer(x),  # no z
        lambda: layer(x.astype(np.int32), x),
        lambda: layer(np.ones((4, 2)), np.ones((4, 2))),
        lambda: layer([[1.0]], x),
    ):
        with pytest.raises(InfiniError):
            call()
        assert layer.weight is None and layer.num_batches_tracked == 0
    layer.eval()
    with pytest.raises(InfiniError):
        layer(x, np.ones((4, 2)))  # z unlike input, eval mode


@pytest.mark.parametrize("dims", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("name", ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"])
def test_dimension_classes_take_torch_s_input_dimensions_alone(name, dims):
    """``cudnn_bn.nn.BatchNorm2d`` (1d, 3d) raises where torch's does, with its message
    (``expected 4D input (got 3D input)``) as BAD_TENSOR_SHAPE (a ValueError), changing
    nothing; the package had only ``BatchNorm``, which takes 2 to 5 dimensions."""
    import cudnn_bn.nn

    x = np.random.default_rng(14).standard_normal((4, 3, 2, 2, 2, 2)[:dims])
    module, layer = getattr(torch.nn, name)(3).double(), getattr(cudnn_bn.nn, name)(3)
    try:
        expected = module(torch.tensor(x))
    except ValueError as error:
        with pytest.raises(ValueError, match=re.escape(str(error))):
            layer(x)
        assert layer.num_batches_tracked == 0 and layer.weight is None
    else:
        close("output", layer(x), expected, 1e-12)
        assert repr(layer) == repr(module)


# --- SyncBatchNorm in a group of one ------------------------------------------------------------


@pytest.fixture(params=["mpi", "gloo"])
def group_of_one(request):
    """(group, array library): mpi4py's COMM_SELF with NumPy arrays, or a torch.distributed
    gloo world of one over 127.0.0.1 with torch tensors (torn down afterwards)."""
    if request.param == "mpi":
        yield pytest.importorskip("mpi4py.MPI").COMM_SELF, "numpy"
        return
    dist = pytest.importorskip("torch.distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD, "torch"
    finally:
        dist.destroy_process_group()


def test_sync_batch_norm_in_a_group_of_one_is_batch_norm(group_of_one):
    group, lib = group_of_one
    rng = np.random.default_rng(11)
    for fusion in (None, "add_relu"):
        plain = BatchNorm(3, momentum=None, fusion=fusion)
        sync = SyncBatchNorm(3, momentum=None, fusion=fusion, group=group)
        for training in (True, True, False, True):
            plain.train(training)
            sync.train(training)
            x, dy, z = (make(rng.standard_normal((5, 3, 4)), lib, "f64") for _ in range(3))
            z = z if fusion else None
            close("output", sync(x, z), plain(x, z), 1e-12)
            got, want = sync.backward(dy), plain.backward(dy)
            for g, w in zip(*(r if fusion else (r,) for r in (got, want)), strict=True):
                close("gradient", g, w, 1e-12)
            for name, value in plain.state_dict().items():
                close(name, sync.state_dict()[name], value, 1e-12)
            close("weight_grad", sync.weight_grad, plain.weight_grad, 1e-12)
        if fusion:  # a residual unlike the input: raises before anything is written
            before = {n: host(v) for n, v in sync.state_dict().items()}
            with pytest.raises(InfiniError) as info:
                sync(x, z[:, :2])
            assert info.value.status == Status.BAD_PARAM
            for name, value in sync.state_dict().items():
                np.testing.assert_array_equal(host(value), before[name])
            sync(x, z)
            with pytest.raises(InfiniError) as info:
                sync.backward(dy[:1])  # would broadcast; refused on every rank
            assert info.value.status == Status.BAD_PARAM


class ThreadRanks:
    """An mpi4py-like intracommunicator whose ranks are threads: buffer collectives between
    barriers that time out (a rank that never joins breaks them, as MPI would hang)."""

    def __init__(self, world: "ThreadWorld", rank: int) -> None:
        self.world, self.rank = world, rank

    def Get_rank(self) -> int:  # mpi4py's names
        return self.rank

    def Get_size(self) -> int:
        return len(self.world.slots)

    def Is_inter(self) -> bool:
        return False

    def _everyone(self, values: np.ndarray) -> list[np.ndarray]:
        self.world.slots[self.rank] = np.array(values)
        self.world.barrier.wait()
        everyone = list(self.world.slots)
        self.world.barrier.wait()
        return everyone

    def Allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        recv[...] = np.stack(self._everyone(send))

    def Allreduce(self, send: np.ndarray, recv: np.ndarray, op: object = None) -> None:
        recv[...] = np.sum(self._everyone(send), axis=0)


class ThreadWorld:
    def __init__(self, size: int) -> None:
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=5)


def on_two_ranks(rank) -> None:
    """``rank(0)`` and ``rank(1)`` on two threads (``ThreadRanks``' ranks), joined within 30 s."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)


BAD_GRAD_OUTPUTS = {  # what rank 1 gives a fused backward that its layer refuses
    "float32": lambda y: np.ones(y.shape, np.float32),
    "torch": lambda y: torch.ones(y.shape, dtype=torch.float64),  # for NumPy layers
}


@pytest.mark.parametrize("bad", list(BAD_GRAD_OUTPUTS))
@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
def test_a_fused_sync_backward_with_a_bad_grad_output_on_one_rank_raises_on_every_rank(fusion, bad):
    """A fused ``SyncBatchNorm``'s backward checked ``grad_output`` on its rank alone and
    raised there, before the collective the other ranks then waited in for ever (here:
    their barrier timed out). The refusal now reaches every rank in the pass's header
    exchange (``refuse_on_every_rank``, as the forward's), so all raise with its status and
    none computes."""
    pytest.importorskip("mpi4py")
    world, results = ThreadWorld(2), [None, None]

    def rank(r: int) -> None:
        layer = SyncBatchNorm(3, fusion=fusion, group=ThreadRanks(world, r))
        x = np.random.default_rng(r).standard_normal((4, 3, 2))
        z = np.zeros_like(x) if fusion == "add_relu" else None
        y = layer(x, z)
        dy = np.ones_like(y) if r == 0 else BAD_GRAD_OUTPUTS[bad](y)
        try:
            layer.backward(dy)
        except Exception as exc:
            results[r] = exc

    on_two_ranks(rank)
    assert all(isinstance(e, InfiniError) for e in results), results
    assert [e.status for e in results] == [Status.BAD_PARAM] * 2, results
    assert "grad_output" in str(results[1]) and "rank 1" in str(results[0]), results


ONE_RANK_REFUSALS = {  # what rank 1's layer refuses itself, before the synchronized pass
    "input a list": dict(input=lambda x: x.tolist()),
    "input of another library": dict(input=torch.from_numpy),
    "z unlike input": dict(fusion="add_relu", z=lambda x: x[:, :2]),
    "z missing": dict(fusion="add_relu", z=lambda _: None),
    "eps 0": dict(eps=0.0),
}


@pytest.mark.parametrize("case", list(ONE_RANK_REFUSALS))
def test_a_training_forward_refused_by_one_rank_s_layer_raises_on_every_rank(case):
    """What ``SyncBatchNorm.forward`` refuses before the synchronized pass (its input's
    library, ``z``, ``eps``) raised on that rank alone, while the others waited in the pass's
    header exchange for ever (here: their barrier timed out). Now every rank raises, and
    none moves its running statistics."""
    pytest.importorskip("mpi4py")
    change = ONE_RANK_REFUSALS[case]
    world, results, states = ThreadWorld(2), [None, None], [None, None]

    def rank(r: int) -> None:
        mine = change if r == 1 else {}
        fusion = change.get("fusion")
        eps, group = mine.get("eps", 1e-5), ThreadRanks(world, r)
        layer = SyncBatchNorm(3, eps=eps, fusion=fusion, group=group, like=np.zeros(1))
        x = np.random.default_rng(r).standard_normal((4, 3, 2))
        z = mine["z"](x) if "z" in mine else np.zeros_like(x) if fusion else None
        before = numpy_like_state(layer)
        try:
            layer(mine.get("input", np.asarray)(x), z)
        except Exception as exc:
            results[r] = exc
        states[r] = (before, numpy_like_state(layer), layer.num_batches_tracked)

    on_two_ranks(rank)
    assert all(isinstance(e, InfiniError) for e in results), results
    assert results[0].status == results[1].status, results
    assert "rank 1" in str(results[0]), results
    for before, after, count in states:
        assert count == 0
        for name, value in before.items():
            np.testing.assert_array_equal(after[name], value)


def numpy_like_state(layer: BatchNorm) -> dict[str, np.ndarray]:
    return {n: np.array(host(v)) for n, v in layer.state_dict().items()}


def test_convert_sync_batchnorm_is_torch_s_over_the_layers_of_a_model():
    """torch's ``SyncBatchNorm.convert_sync_batchnorm``: each batch norm becomes a
    ``SyncBatchNorm`` with its flags, mode, count and the same arrays; the rest stays. The
    layer had none (AttributeError). In a group of one, the converted layer trains as the
    original would."""
    group = pytest.importorskip("mpi4py.MPI").COMM_SELF
    rng = np.random.default_rng(15)
    x, dy = (rng.standard_normal((4, 3, 2, 2)) for _ in range(2))
    layer = BatchNorm(3, momentum=None, bias=False)
    layer(x)
    layer.eval()
    module = torch.nn.BatchNorm2d(3, momentum=None, bias=False).double()
    module(torch.tensor(x))
    module.eval()
    untouched = object()
    sync, kept, unmade = SyncBatchNorm.convert_sync_batchnorm(
        (layer, untouched, BatchNorm(2)), group
    )
    want = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    assert type(sync) is SyncBatchNorm and sync.group is group and kept is untouched
    assert repr(sync) == repr(want) and sync.training is want.training is False
    assert sync.running_var is layer.running_var and sync.weight is layer.weight
    assert sync.num_batches_tracked == int(want.num_batches_tracked) == 1
    assert type(unmade) is SyncBatchNorm and unmade.weight is None
    original = copy.deepcopy(layer).train()
    sync.train()
    close("output", sync(x), original(x), 1e-12)
    close("grad_input", sync.backward(dy), original.backward(dy), 1e-12)
    for name in ("weight", "running_mean", "running_var"):  # shared with the converted one
        close(name, getattr(layer, name), getattr(original, name), 1e-12)
    assert sync.num_batches_tracked == original.num_batches_tracked == 2


# --- on a GPU: CuPy arrays and torch CUDA tensors (cuDNN and the CuPy kernels) ----------------


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["cupy", "cuda"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize(
    ("shape", "channels_last", "fusion"),
    [((8, 3), False, None), ((3, 4, 4, 5), True, "add_relu"), ((2, 3, 2, 3, 4), False, "relu")],
)
def test_gpu_arrays_match_torch(lib, dtype, shape, channels_last, fusion):
    layer = run_scenario(
        shape, lib=lib, dtype=dtype, fusion=fusion, channels_last=channels_last, momentum=None
    )
    assert all(type(a) is type(layer.weight) for a in layer.state_dict().values())


@pytest.mark.parametrize("absent", ["bias=False", "weight=None", "bias=None"])
def test_zero_grad_in_place_with_a_parameter_absent_is_torch_s(absent):
    """``zero_grad(set_to_none=False)`` zeros the gradient of the parameter the layer has and
    leaves the absent one's None, as torch's ``Module.zero_grad``; ``bias=False`` raised a
    raw TypeError, and ``weight=None`` set the bias's gradient to None (review of session 12)."""
    x = np.random.default_rng(16).standard_normal((4, 3, 5))
    layer = BatchNorm(3, bias=absent != "bias=False")
    module = torch.nn.BatchNorm1d(3, bias=absent != "bias=False").double()
    if absent != "bias=False":
        name = absent.partition("=")[0]
        setattr(layer, name, None)
        setattr(module, name, None)
    layer(x)
    layer.backward(np.ones_like(x))
    module(torch.tensor(x)).sum().backward()
    layer.zero_grad(set_to_none=False)
    module.zero_grad(set_to_none=False)
    for ours, theirs in ((layer.weight_grad, module.weight), (layer.bias_grad, module.bias)):
        if theirs is None:
            assert ours is None
        else:
            np.testing.assert_array_equal(ours, theirs.grad.numpy())


def test_sync_batch_norm_with_weight_none_has_the_bias_gradient(group_of_one):
    """A ``SyncBatchNorm`` whose weight is set to None still has its bias's gradient, as
    ``BatchNorm`` and torch's ``SyncBatchNorm`` have (it was None: the sync backward gave no
    gradient without a weight; review of session 12)."""
    group, lib = group_of_one
    rng = np.random.default_rng(17)
    x, dy = (rng.standard_normal((4, 3, 5)) for _ in range(2))
    sync, plain = SyncBatchNorm(3, group=group), BatchNorm(3)
    sync.weight = plain.weight = None
    sync(make(x, lib, "f64"))
    sync.backward(make(dy, lib, "f64"))
    plain(x)
    plain.backward(dy)
    module = torch.nn.BatchNorm1d(3).double()
    module.weight = None
    module(torch.tensor(x)).backward(torch.tensor(dy))
    assert sync.weight_grad is None
    close("bias_grad", sync.bias_grad, module.bias.grad.numpy(), 1e-12)
    close("bias_grad", plain.bias_grad, module.bias.grad.numpy(), 1e-12)


def test_convert_sync_batchnorm_keeps_a_mapping_s_type():
    """An ``OrderedDict`` of layers comes back an ``OrderedDict`` (it came back a dict)."""
    group = pytest.importorskip("mpi4py.MPI").COMM_SELF
    layers = OrderedDict(a=BatchNorm(2), b=BatchNorm(3))
    converted = SyncBatchNorm.convert_sync_batchnorm(layers, group)
    assert type(converted) is OrderedDict and list(converted) == ["a", "b"]
    assert all(type(v) is SyncBatchNorm for v in converted.values())


@pytest.mark.gpu
def test_gpu_sync_batch_norm_with_weight_none_has_the_bias_gradient():
    """On a GPU (MPI's ``COMM_SELF``, CuPy arrays, their per-channel values staged through
    the host): a ``SyncBatchNorm`` whose weight is None has its bias's gradient, on the input's
    device in the saved statistics' dtype, as torch's; verified on the host (NumPy, torch
    CPU) only, by ``test_sync_batch_norm_with_weight_none_has_the_bias_gradient``."""
    group = pytest.importorskip("mpi4py.MPI").COMM_SELF
    rng = np.random.default_rng(18)
    x, dy = (rng.standard_normal((4, 3, 5)) for _ in range(2))
    sync = SyncBatchNorm(3, group=group)
    sync.weight = None
    sync(make(x, "cupy", "f32"))
    sync.backward(make(dy, "cupy", "f32"))
    module = torch.nn.BatchNorm1d(3).double()
    module.weight = None
    module(torch.tensor(x)).backward(torch.tensor(dy))
    assert sync.weight_grad is None
    assert type(sync.bias_grad) is type(sync.bias)
    close("bias_grad", sync.bias_grad, module.bias.grad.numpy(), 1e-5)
