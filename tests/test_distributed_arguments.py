"""The synchronized passes in a group of one (mpi4py's ``COMM_SELF``, in this process): every
argument checked on the caller's own array, as the array API checks it, and refused with an
``InfiniError`` naming it as the caller does, nothing written; results against PyTorch's
float64; N = 0 and absent weight/bias as PyTorch treats them.
"""

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fake_devices import fake_torch, torch_tensor
from helpers import EPS, random_values, reference

from cudnn_bn import InfiniError, Status
from cudnn_bn.distributed import sync_batch_norm_backward, sync_batch_norm_forward_training

pytest.importorskip("mpi4py", reason="the test extra installs mpi4py")
from mpi4py import MPI

SELF = MPI.COMM_SELF
NAMES = ("input", "weight", "bias", "running_mean", "running_var")


def _problem(shape=(6, 3, 4), dtype=np.float64, seed=1) -> dict:
    return {n: a.astype(dtype) for n, a in random_values(shape, seed, bias=True).items()}


def _forward(p: dict, **options):
    return sync_batch_norm_forward_training(*(p[n] for n in NAMES), group=SELF, **options)


def _refused(call, status: Status, *words: str) -> str:
    with pytest.raises(InfiniError) as info:
        call()
    assert info.value.status == status, info.value
    message = str(info.value)
    assert all(w in message for w in words), message
    return message


# --- issue 16 #7: the caller's own running statistics, not copies, are checked ------------------

ALIASES = {
    "running_mean is running_var": lambda p: {"running_var": p["running_mean"]},
    "running_mean is weight": lambda p: {"running_mean": p["weight"]},
    "running_var is bias": lambda p: {"running_var": p["bias"]},
    "running_mean views input": lambda p: {"running_mean": p["input"][0, :, 0]},
}


@pytest.mark.parametrize("alias", list(ALIASES))
def test_running_statistics_sharing_memory_with_an_argument_are_refused(alias):
    p = _problem()
    p.update(ALIASES[alias](p))
    before = {n: p[n].copy() for n in NAMES}
    written = alias.split()[0]
    _refused(lambda: _forward(p), Status.BAD_PARAM, written, "share memory")
    for name in NAMES:
        np.testing.assert_array_equal(p[name], before[name], err_msg=f"{name} was written")


def test_a_read_only_running_statistic_is_refused():
    p = _problem()
    p["running_var"].flags.writeable = False
    _refused(lambda: _forward(p), Status.BAD_PARAM, "running_var is read-only")


def _freed() -> MPI.Comm:
    comm = SELF.Dup()
    comm.Free()  # mpi4py makes it MPI.COMM_NULL
    return comm


@pytest.mark.parametrize("null", [lambda: MPI.COMM_NULL, _freed], ids=["COMM_NULL", "freed"])
def test_a_null_communicator_is_bad_param_naming_the_group(null):
    p = _problem()
    before = {n: p[n].copy() for n in NAMES}
    _refused(lambda: sync_batch_norm_forward_training(*(p[n] for n in NAMES), group=null()),
             Status.BAD_PARAM, "group", "COMM_NULL")  # fmt: skip
    x, w = p["input"], p["weight"]
    _refused(lambda: sync_batch_norm_backward(x, x, w, p["bias"], p["running_var"], group=null()),
             Status.BAD_PARAM, "group", "COMM_NULL")  # fmt: skip
    for name in NAMES:
        np.testing.assert_array_equal(p[name], before[name], err_msg=f"{name} was written")


# --- issue 16 #9: float64 statistics normalize F32 data ------------------------------------------


def test_float32_data_far_from_zero_normalizes_within_float32_rounding():
    """Data 1000 ± 0.01 in F32: with the global statistics rounded to F32 before normalizing,
    the output was off by 3e-3; in float64 it is one F32 rounding from PyTorch's float64."""
    rng = np.random.default_rng(3)
    x = (1000 + 0.01 * rng.standard_normal((64, 3, 50))).astype(np.float32)
    w, b = np.array([1.0, 2.0, 0.5], np.float32), np.array([0.0, 1.0, -1.0], np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    y, mean, invstd = sync_batch_norm_forward_training(x, w, b, rm, rv, group=SELF)
    x64 = torch.from_numpy(x.astype(np.float64))
    w64, b64 = torch.from_numpy(w.astype(np.float64)), torch.from_numpy(b.astype(np.float64))
    want = F.batch_norm(x64, None, None, w64, b64, training=True, eps=EPS).numpy()
    assert np.abs(y - want).max() < 1e-6  # |y| < 5: a few F32 ulps
    var = x64.var(dim=(0, 2), unbiased=False).numpy()
    np.testing.assert_allclose(mean, x64.mean(dim=(0, 2)).numpy(), rtol=1e-7)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(var + EPS), rtol=1e-7)


# --- issue 16 #10, #11: only InfiniError, naming the caller's arguments --------------------------


def _backward_args(p: dict) -> dict:
    _, mean, invstd = _forward(p)
    return dict(
        input=p["input"],
        grad_output=p["grad_output"],
        weight=p["weight"],
        saved_mean=mean,
        saved_invstd=invstd,
    )


BAD_BACKWARD = {
    "grad_output a list": (dict(grad_output=[[1.0]]), Status.BAD_PARAM, "grad_output"),
    "torch grad_output, NumPy input": (
        dict(grad_output=torch.ones(6, 3, 4, dtype=torch.float64)),
        Status.BAD_PARAM,
        "grad_output",
    ),
    "weight a string": (dict(weight="w"), Status.BAD_PARAM, "weight"),
    "saved_mean of 4 channels": (
        dict(saved_mean=np.zeros(4)),
        Status.BAD_TENSOR_SHAPE,
        "saved_mean",
    ),
    "saved_invstd F32": (
        dict(saved_invstd=np.ones(3, np.float32)),
        Status.BAD_TENSOR_DTYPE,
        "saved_invstd",
    ),
    "saved_invstd None": (dict(saved_invstd=None), Status.NULL_POINTER, "saved_invstd"),
    "grad_output of another shape": (
        dict(grad_output=np.ones((6, 3, 5))),
        Status.BAD_TENSOR_SHAPE,
        "grad_output",
    ),
}


@pytest.mark.parametrize("case", list(BAD_BACKWARD))
def test_backward_refuses_with_the_callers_names(case):
    changes, status, name = BAD_BACKWARD[case]
    args = {**_backward_args(_problem()), **changes}
    message = _refused(lambda: sync_batch_norm_backward(**args, group=SELF), status, name)
    assert "running_mean" not in message and "running_var" not in message, message


def test_per_channel_arrays_of_another_kind_are_updated_and_checked_alike():
    """A torch running mean beside NumPy data (the array API takes such mixes) is moved in
    place; one of 4 channels is refused, named."""
    p = _problem()
    p["running_mean"] = torch.zeros(3, dtype=torch.float64)
    _forward(p)
    assert p["running_mean"].abs().sum() > 0
    p["running_mean"] = torch.zeros(4, dtype=torch.float64)
    _refused(lambda: _forward(p), Status.BAD_TENSOR_SHAPE, "running_mean")


@pytest.mark.parametrize("made", ["inference_mode", "Parameter"])
def test_torch_running_statistics_of_any_autograd_state_are_moved(made):
    """Running statistics made under ``torch.inference_mode()`` (or a ``Parameter``) are
    moved as the array API moves them: torch refuses an inference tensor's in-place update
    outside inference mode, and only after writing it, so the update once raised
    INTERNAL_ERROR past the collectives with both statistics written. A ``Parameter``,
    which requires grad, only where grad mode is off, as torch's own batch norm."""
    p = _problem()
    want = {n: torch.from_numpy(p[n].copy()) for n in ("running_mean", "running_var")}
    for name in want:
        if made == "inference_mode":
            with torch.inference_mode():
                p[name] = torch.from_numpy(p[name].copy())
        else:
            p[name] = torch.nn.Parameter(torch.from_numpy(p[name].copy()))
    if made == "Parameter":
        _refused(lambda: _forward(p), Status.BAD_PARAM, "running_mean requires grad")
    with torch.no_grad():
        y, _, _ = _forward(p)
    x, w, b = (torch.from_numpy(p[n]) for n in ("input", "weight", "bias"))
    want_y = F.batch_norm(x, want["running_mean"], want["running_var"], w, b, True, eps=EPS)
    np.testing.assert_allclose(y, want_y.numpy(), rtol=1e-12, atol=1e-12)
    for name, values in want.items():
        np.testing.assert_allclose(p[name].detach().numpy(), values.numpy(), rtol=1e-12)


# --- issue 16 #14: N = 0, weight/bias None ----------------------------------------------------


def test_an_empty_batch_gives_empty_outputs_and_leaves_the_running_statistics():
    p = _problem((0, 3, 4))
    before = {n: p[n].copy() for n in ("running_mean", "running_var")}
    y, mean, invstd = _forward(p)
    assert y.shape == (0, 3, 4) and mean.shape == invstd.shape == (3,)
    for name, values in before.items():
        np.testing.assert_array_equal(p[name], values)
    dx, dw, db = sync_batch_norm_backward(
        p["input"], p["grad_output"], p["weight"], mean, invstd, group=SELF
    )
    assert dx.shape == (0, 3, 4)
    np.testing.assert_array_equal(dw, np.zeros(3))
    np.testing.assert_array_equal(db, np.zeros(3))


@pytest.mark.parametrize("absent", [("weight",), ("bias",), ("weight", "bias")])
def test_absent_weight_or_bias_is_one_or_zero_as_in_torch(absent):
    p = _problem()
    for name in absent:
        p[name] = None
    rm, rv = (torch.from_numpy(p[n].copy()) for n in ("running_mean", "running_var"))
    y, mean, invstd = _forward(p)
    t = {n: None if p[n] is None else torch.from_numpy(p[n]) for n in ("weight", "bias")}
    x = torch.from_numpy(p["input"])
    want = F.batch_norm(x, rm, rv, t["weight"], t["bias"], training=True, eps=EPS)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p["running_var"], rv.numpy(), rtol=1e-12)
    grads = sync_batch_norm_backward(
        p["input"], p["grad_output"], p["weight"], mean, invstd, group=SELF
    )
    w = np.ones(3) if p["weight"] is None else p["weight"]
    saved = dict(mode="saved", mean=mean, invstd=invstd)
    want_grads = reference(p["input"], p["grad_output"], w, **saved)
    np.testing.assert_allclose(grads[0], want_grads[0].numpy(), rtol=1e-10, atol=1e-12)
    if p["weight"] is None:  # no weight, no weight gradient; a bias's still (torch's)
        assert grads[1] is None
    else:
        np.testing.assert_allclose(grads[1], want_grads[1].numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads[2], want_grads[2].numpy(), rtol=1e-10, atol=1e-12)
    assert grads[2].dtype == mean.dtype


# --- issue 19 #4: the torch stream object of the tensor's own device ---------------------------


def test_the_pass_scope_makes_the_stream_current_on_the_tensors_device(monkeypatch):
    """A torch tensor on device 1 while device 0 is current, with ``stream=``: the stream
    object is built for device 1 (``ExternalStream(..., device=1)``), where it is entered."""
    from cudnn_bn import arrays
    from cudnn_bn.distributed.kinds import scope

    arrays.torch_stream.cache_clear()
    with fake_torch(monkeypatch, {0: 0xA00, 1: 0xA10}) as log:
        tensor = torch_tensor((4, 3), device=1)
        with scope(tensor, 0x5B00, 1):
            torch.empty_strided((3,), (1,), dtype=torch.float32, device=tensor.device)
    arrays.torch_stream.cache_clear()
    assert log == [(1, 0x5B00)]


def test_a_destroyed_torch_group_is_bad_param():
    """A torch.distributed group used after ``destroy_process_group()`` (as MPI's
    ``COMM_NULL`` after ``Free()``) is a bad ``group``: torch's own "Default process group
    has not been initialized" came out as INTERNAL_ERROR (found attacking the package)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.group.WORLD
    dist.destroy_process_group()
    x = torch.ones(4, 3, dtype=torch.float64)
    with pytest.raises(InfiniError) as info:
        sync_batch_norm_forward_training(x, None, None, None, None, group=group)
    assert info.value.status == Status.BAD_PARAM and "destroy_process_group" in str(info.value)
