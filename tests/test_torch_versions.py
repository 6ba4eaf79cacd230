"""torch tensors written in place, held to torch's own rules for in-place writes.

Each write of a caller's tensor bumps its autograd version counter once, as torch's in-place
ops do, so a tensor some torch op saved for backward and a call then overwrote makes
``backward()`` raise torch's RuntimeError instead of computing a wrong gradient. A write
torch would refuse (a tensor that requires grad, grad mode on) is refused before anything
is written. Every expectation is taken from torch itself, on the same tensors.
"""

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cudnn_bn
from cudnn_bn import InfiniError, Status
from cudnn_bn.distributed import sync_batch_norm_forward_training
from cudnn_bn.nn import BatchNorm

SHAPE, C = (6, 3, 4), 3


def _data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(SHAPE, generator=g),
        "dy": torch.randn(SHAPE, generator=g),
        "w": torch.rand(C, generator=g) + 0.5,
        "b": torch.randn(C, generator=g),
        "rm": torch.zeros(C),
        "rv": torch.ones(C),
    }


def _train(target: torch.Tensor, d: dict) -> None:
    cudnn_bn.batch_norm_forward_training(d["x"], d["w"], d["b"], target, d["rv"])


def _train_out(target: torch.Tensor, d: dict) -> None:
    out = (torch.empty(SHAPE), target, None)
    cudnn_bn.batch_norm_forward_training(d["x"], d["w"], d["b"], d["rm"], d["rv"], out=out)


def _infer_out(target: torch.Tensor, d: dict) -> None:
    cudnn_bn.batch_norm_forward_inference(d["x"], d["w"], d["b"], d["rm"], d["rv"], out=target)


def _backward_out(target: torch.Tensor, d: dict) -> None:
    out = (None, None, target)
    cudnn_bn.batch_norm_backward(d["x"], d["dy"], d["w"], d["rm"], d["rv"], out=out)


def _backward_grad_input(target: torch.Tensor, d: dict) -> None:
    out = (target, None, None)
    cudnn_bn.batch_norm_backward(d["x"], d["dy"], d["w"], d["rm"], d["rv"], out=out)


# (the call writing ``target``, its shape, the argument as the caller spells it)
WRITES: dict[str, tuple[Callable[[torch.Tensor, dict], None], tuple[int, ...], str]] = {
    "training running_mean": (_train, (C,), "running_mean"),
    "training out[1]": (_train_out, (C,), "out[1]"),
    "inference out=": (_infer_out, SHAPE, "out"),
    "backward out[2]": (_backward_out, (C,), "out[2]"),
    "backward grad_input in place": (_backward_grad_input, SHAPE, "out[0]"),
}


def _saved(target: torch.Tensor) -> torch.Tensor:
    """A loss whose backward reads ``target`` as ``y = x * target`` saved it."""
    x = torch.rand(target.shape, requires_grad=True)
    return (x * target).sum()


def _torch_error(target_like: torch.Tensor, write: Callable[[torch.Tensor], Any]) -> str:
    """torch's error from ``backward()`` after ``write`` (a torch in-place op) changed a
    saved tensor like ``target_like``."""
    twin = torch.zeros_like(target_like)
    loss = _saved(twin)
    write(twin)
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    return str(info.value)


@pytest.mark.parametrize("case", WRITES)
def test_a_saved_tensor_written_in_place_makes_backward_raise_as_torchs_add_(case):
    call, shape, _ = WRITES[case]
    d, target = _data(), torch.zeros(shape)
    loss = _saved(target)
    before = target._version
    call(target, d)
    twin = torch.zeros(shape)
    twin_before = twin._version
    twin.add_(1)
    assert target._version - before == twin._version - twin_before == 1
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    assert str(info.value) == _torch_error(target, lambda t: t.add_(1))


@pytest.mark.parametrize("case", WRITES)
def test_each_planned_call_bumps_once(case):
    call, shape, _ = WRITES[case]
    d, target = _data(), torch.zeros(shape)
    versions = [target._version]
    for _ in range(3):  # the first builds the plan, the others find it
        call(target, d)
        versions.append(target._version)
    assert np.diff(versions).tolist() == [1, 1, 1]


@pytest.mark.parametrize("case", WRITES)
@pytest.mark.parametrize("view", [False, True])
def test_a_leaf_that_requires_grad_is_refused_as_torch_refuses_it(case, view):
    call, shape, name = WRITES[case]
    leaf = torch.zeros(shape, requires_grad=True)
    target = leaf[...] if view else leaf
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        target.add_(1)  # torch's own in-place write
    d = _data()
    expected = {n: t.clone() for n, t in d.items()}
    with pytest.raises(InfiniError) as info:
        call(target, d)
    assert info.value.status == Status.BAD_PARAM
    assert str(info.value).startswith(f"BAD_PARAM: {name} requires grad"), info.value
    assert "leaf" in str(info.value) and isinstance(info.value, ValueError)
    assert leaf._version == 0 and not leaf.detach().any()  # nothing written
    for n, t in d.items():
        assert torch.equal(t, expected[n]), n


@pytest.mark.parametrize("case", WRITES)
def test_a_non_leaf_that_requires_grad_is_refused_as_torchs_out_is(case):
    """torch rebases a non-leaf's history onto its in-place op; this write has none to give
    it, so the tensor would keep a gradient that no longer describes it: refused, as torch
    refuses an ``out=`` or a batch norm's running statistic that requires grad."""
    call, shape, name = WRITES[case]
    target = torch.zeros(shape, requires_grad=True) * 1
    with pytest.raises(RuntimeError, match="requires grad"):
        torch.add(torch.zeros(shape), 1, out=target)
    with pytest.raises(RuntimeError, match="cannot have requires_grad True"):
        F.batch_norm(torch.rand(4, C), target.reshape(-1)[:C], torch.ones(C), training=True)
    with pytest.raises(InfiniError, match=f"^BAD_PARAM: {re.escape(name)} requires grad"):
        call(target, _data())
    assert target._version == 0


@pytest.mark.parametrize("case", WRITES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_grad_mode_off_lets_a_leaf_be_written_and_bumps_it_as_torch(case, mode):
    call, shape, _ = WRITES[case]
    leaf, twin = torch.zeros(shape, requires_grad=True), torch.zeros(shape, requires_grad=True)
    with getattr(torch, mode)():
        twin.add_(1)
        call(leaf, _data())
    assert leaf._version == twin._version == 1
    assert leaf.requires_grad and leaf.is_leaf


@pytest.mark.parametrize("case", WRITES)
def test_an_inference_tensor_is_written_and_has_no_version_to_bump(case):
    """torch's ``F.batch_norm`` writes inference running statistics outside inference mode
    too; such a tensor cannot be saved for backward, so no gradient can go wrong."""
    call, shape, _ = WRITES[case]
    with torch.inference_mode():
        target = torch.full(shape, 7.0)
    with pytest.raises(RuntimeError, match="cannot be saved for backward"):
        _saved(target)
    call(target, _data())
    assert not torch.equal(target, torch.full(shape, 7.0))


@pytest.mark.parametrize("case", WRITES)
def test_a_call_that_fails_bumps_nothing(case):
    call, shape, _ = WRITES[case]
    d, target = _data(), torch.zeros(shape)
    call(target, d)  # planned
    before = target._version
    d["x"] = torch.randn(6, C + 1, 4)  # another problem, refused: C + 1 channels
    with pytest.raises(InfiniError):
        call(target, d)
    assert target._version == before


def test_a_refused_overlap_on_a_planned_call_bumps_nothing():
    d = _data()
    cudnn_bn.batch_norm_forward_training(d["x"], d["w"], d["b"], d["rm"], d["rv"])
    before = d["rm"]._version
    with pytest.raises(InfiniError, match="share memory"):
        cudnn_bn.batch_norm_forward_training(d["x"], d["w"], d["b"], d["rm"], d["rm"])
    assert d["rm"]._version == before


def test_a_tensor_given_but_not_written_is_neither_bumped_nor_refused():
    """An ``out=`` entry masked off, an empty batch's running statistics: left as they are,
    so a tensor saved from them still gives its gradient."""
    d = _data()
    grad_weight, leaf = torch.zeros(C), torch.zeros(C, requires_grad=True)
    loss = _saved(grad_weight)
    cudnn_bn.batch_norm_backward(
        d["x"], d["dy"], d["w"], None, None, out=(None, grad_weight, leaf),
        output_mask=(True, False, False),
    )  # fmt: skip
    for empty in ((0, C, 4), (2, C, 0)):
        cudnn_bn.batch_norm_forward_training(torch.rand(empty), d["w"], d["b"], d["rm"], leaf)
    assert grad_weight._version == leaf._version == d["rm"]._version == 0
    loss.backward()


def test_tensors_only_read_may_require_grad():
    d = _data()
    w, b = d["w"].requires_grad_(), d["b"].requires_grad_()
    x = d["x"].requires_grad_()
    output, *_ = cudnn_bn.batch_norm_forward_training(x, w, b, d["rm"], d["rv"])
    assert output.shape == SHAPE and w._version == b._version == x._version == 0


def test_a_subclass_written_in_place_is_bumped_and_refused_as_a_plain_tensor():
    class Tagged(torch.Tensor):
        pass

    d = _data()
    target = torch.zeros(C).as_subclass(Tagged)
    loss = _saved(target)
    _train(target, d)
    assert target._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    leaf = torch.Tensor._make_subclass(Tagged, torch.zeros(C), True)
    assert leaf.requires_grad and leaf.is_leaf
    with pytest.raises(InfiniError, match=r"^BAD_PARAM: running_mean requires grad"):
        _train(leaf, d)


@pytest.mark.parametrize("case", WRITES)
def test_a_subclass_whose_properties_lie_is_refused_as_torch_refuses_it(case):
    """A subclass's Python property (no ``__torch_function__``) saying a leaf that requires
    grad does not, or is no leaf: torch's own getters answer, as its in-place check reads
    them, so the write is refused as the leaf's, and nothing is written."""

    class NoGrad(torch.Tensor):
        requires_grad = property(lambda self: False)

    class NoLeaf(torch.Tensor):
        is_leaf = property(lambda self: False)

    call, shape, name = WRITES[case]
    for kind in (NoGrad, NoLeaf):
        leaf = torch.Tensor._make_subclass(kind, torch.full(shape, 7.0), True)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            torch.Tensor.add_(leaf, 1)
        with pytest.raises(InfiniError, match=rf"^BAD_PARAM: {re.escape(name)} requires grad.*"
                           "a leaf Variable"):  # fmt: skip
            call(leaf, _data())
        assert leaf._version == 0 and torch.equal(leaf.detach(), torch.full(shape, 7.0))


def test_a_layers_running_statistics_are_bumped_by_its_training_forward():
    layer, d = BatchNorm(C), _data()
    layer.forward(d["x"])
    saved_mean, saved_var = _saved(layer.running_mean), _saved(layer.running_var)
    versions = layer.running_mean._version, layer.running_var._version
    layer.forward(d["x"])
    assert (layer.running_mean._version, layer.running_var._version) == (
        versions[0] + 1,
        versions[1] + 1,
    )
    for loss in (saved_mean, saved_var):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_layers_gradients_and_loaded_state_are_bumped():
    layer, d = BatchNorm(C), _data()
    layer.forward(d["x"])
    layer.backward(d["dy"])
    loss = _saved(layer.weight_grad)
    before = layer.weight_grad._version
    layer.forward(d["x"])
    layer.backward(d["dy"])  # added in place
    assert layer.weight_grad._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss, before = _saved(layer.weight), layer.weight._version
    layer.load_state_dict(layer.state_dict())
    assert layer.weight._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_layers_running_statistic_that_requires_grad_is_refused_as_torchs():
    torch_layer = torch.nn.BatchNorm1d(C)
    torch_layer.running_mean.requires_grad_()
    with pytest.raises(RuntimeError, match="running_mean"):
        torch_layer(torch.rand(4, C))
    layer, d = BatchNorm(C), _data()
    layer.forward(d["x"])
    layer.running_mean.requires_grad_()
    state = {n: t.detach().clone() for n, t in layer.state_dict().items()}
    with pytest.raises(InfiniError, match=r"^BAD_PARAM: running_mean requires grad"):
        layer.forward(d["x"])
    for name, value in layer.state_dict().items():
        assert torch.equal(torch.as_tensor(value).detach(), torch.as_tensor(state[name])), name


@pytest.fixture
def gloo_group_of_one():
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable, or initialized by someone else")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_synchronized_forward_bumps_and_refuses_as_the_array_api(gloo_group_of_one):
    d = _data()
    loss = _saved(d["rm"])
    sync_batch_norm_forward_training(
        d["x"], d["w"], d["b"], d["rm"], d["rv"], group=gloo_group_of_one
    )
    assert d["rm"]._version == d["rv"]._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    leaf = torch.zeros(C, requires_grad=True)
    with pytest.raises(InfiniError, match=r"^BAD_PARAM: running_var requires grad") as info:
        sync_batch_norm_forward_training(
            d["x"], d["w"], d["b"], d["rm"], leaf, group=gloo_group_of_one
        )
    assert info.value.status == Status.BAD_PARAM
    assert leaf._version == 0 and d["rm"]._version == 1
