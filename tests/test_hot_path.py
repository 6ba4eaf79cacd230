"""The per-problem plan (issue 17): a repeated call reuses its plan, yet every check the door
and the operators make still holds on a hit; ``out=`` arrays for every pass; the batched
backward as one call; ``weight=None``/``bias=None`` (issue 16, finding 15) and the saved
statistics named as the caller named them (finding 11). References: torch in float64."""

import copy
import gc
import pickle
import weakref

import numpy as np
import pytest
import torch
from producers import NumpyDLPack

import cudnn_bn
from cudnn_bn import InfiniError, Status
from cudnn_bn.api import call
from cudnn_bn.arrays import numpy_arrays

C = 3
F = torch.nn.functional


def problem(shape=(4, C, 5), dtype=np.float64, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(dtype)
    b = rng.standard_normal(shape[1]).astype(dtype)
    return x, dy, w, b


def torch_training(x, dy, w, b):
    """(output, grad_input, grad_weight, grad_bias) by torch in float64 (None weight/bias:
    affine=False)."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = None if w is None else torch.tensor(w, dtype=torch.float64, requires_grad=True)
    bt = None if b is None else torch.tensor(b, dtype=torch.float64, requires_grad=True)
    y = F.batch_norm(xt, None, None, wt, bt, True, 0.1, 1e-5)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    grad = lambda t: None if t is None else t.grad.numpy()  # noqa: E731
    return y.detach().numpy(), xt.grad.numpy(), grad(wt), grad(bt)


def close(ours, reference):
    np.testing.assert_allclose(np.asarray(ours, np.float64), reference, rtol=1e-9, atol=1e-11)


# --- a hit keeps every check ------------------------------------------------------------------


def test_repeated_calls_share_one_plan():
    cudnn_bn.descriptor_cache.clear()
    x, dy, w, _ = problem()
    for _ in range(3):
        cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    assert len(cudnn_bn.descriptor_cache) == 1


def test_an_evicted_plan_lets_its_launch_go_without_waiting_for_the_garbage_collector():
    # A plan's launch holds its kernel (on a GPU, cuDNN's descriptors): it must go with the
    # plan, not at some later collection of a reference cycle.
    cudnn_bn.descriptor_cache.clear()
    x, dy, w, _ = problem()
    cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    (plan,) = cudnn_bn.descriptor_cache._entries.values()
    call = weakref.ref(plan.call)  # it holds the launch
    del plan
    gc.disable()
    try:
        cudnn_bn.descriptor_cache.clear()
        assert call() is None
    finally:
        gc.enable()


def test_a_refused_call_lets_its_plan_and_arrays_go_without_the_garbage_collector():
    # A call refused on a hit raises from inside the plan's call: no frame its traceback
    # keeps may hold the exception itself (a cycle), or the caller's arrays and the plan,
    # with its launch, live on until some later collection (found in review 7).
    cudnn_bn.descriptor_cache.clear()
    x, _, w, b = problem()
    cudnn_bn.batch_norm_forward_training(x, w, b, np.zeros(C), np.zeros(C))
    (plan,) = cudnn_bn.descriptor_cache._entries.values()
    call = weakref.ref(plan.call)
    del plan
    buffer = np.zeros(2 * C)
    kept = weakref.ref(buffer)
    gc.disable()
    try:
        refused = ""
        try:
            cudnn_bn.batch_norm_forward_training(x, w, b, buffer[1 : C + 1], buffer[:C])
        except InfiniError as exc:
            refused = str(exc)
        assert "running_mean and running_var share memory" in refused
        del buffer
        cudnn_bn.descriptor_cache.clear()
        assert call() is None
        assert kept() is None
    finally:
        gc.enable()


def test_a_read_only_running_statistic_is_refused_after_a_writable_one_planned():
    x, _, w, b = problem()
    running = np.zeros(C)
    cudnn_bn.batch_norm_forward_training(x, w, b, running, None)
    frozen = np.zeros(C)
    frozen.flags.writeable = False
    with pytest.raises(InfiniError, match="running_mean is read-only"):
        cudnn_bn.batch_norm_forward_training(x, w, b, frozen, None)


def test_overlap_is_checked_on_every_call_not_only_when_planned():
    x, _, w, b = problem()
    buffer = np.zeros(2 * C)
    mean, var = buffer[:C], buffer[C:]
    cudnn_bn.batch_norm_forward_training(x, w, b, mean, var)  # the plan: disjoint
    same_layout = np.zeros(2 * C)
    with pytest.raises(InfiniError, match="running_mean and running_var share memory"):
        overlapping = same_layout[1 : C + 1], same_layout[:C]  # same shapes and strides
        cudnn_bn.batch_norm_forward_training(x, w, b, *overlapping)
    assert not same_layout.any()


def test_alignment_is_checked_on_every_call():
    x, dy, w, _ = problem()
    cudnn_bn.batch_norm_backward(x, dy, w, None, None)  # the plan: aligned
    raw = np.zeros(x.nbytes + 1, np.uint8)
    shifted = np.frombuffer(raw.data, np.float64, x.size, offset=1).reshape(x.shape)
    assert shifted.strides == x.strides and not shifted.flags.aligned
    with pytest.raises(InfiniError, match=r"grad_output's data .* not aligned") as caught:
        cudnn_bn.batch_norm_backward(x, shifted, w, None, None)
    assert caught.value.status == Status.BAD_TENSOR_STRIDES


def test_pointers_come_from_ctypes_where_the_array_header_cannot_be_read(monkeypatch):
    # DATA_WORDS is None where the import-time probe of an ndarray's header failed (another
    # layout, tagged pointers): every pointer then comes from ``.ctypes.data``.
    monkeypatch.setattr(numpy_arrays, "DATA_WORDS", None)
    monkeypatch.setattr(call, "DATA_WORDS", None)
    cudnn_bn.descriptor_cache.clear()
    x, dy, w, b = problem()
    out, *_ = torch_training(x, dy, w, b)
    for _ in range(2):  # the plan's first call, then a hit
        close(cudnn_bn.batch_norm_forward_training(x, w, b, None, None)[0], out)
    assert numpy_arrays.ndarray_data(x[1:]) == x[1:].ctypes.data


@pytest.mark.parametrize(("good", "bad"), [(1.0, True), (0.5, np.float64("nan"))])
def test_options_equal_in_python_key_different_plans(good, bad):
    """``True == 1.0`` in Python: a plan for momentum 1.0 must not serve momentum True."""
    x, _, w, b = problem()
    cudnn_bn.batch_norm_forward_training(x, w, b, None, None, momentum=good)
    with pytest.raises(InfiniError, match="momentum"):
        cudnn_bn.batch_norm_forward_training(x, w, b, None, None, momentum=bad)


def test_an_output_mask_given_as_a_list_is_taken_as_its_tuple_is():
    """``check_output_mask`` takes a list; the plan's key once could not hash one (found by
    the fuzzer) and refused it as an "unhashable option"."""
    x, dy, w, b = problem()
    _, gx_ref, _, gb_ref = torch_training(x, dy, w, b)
    for _ in range(2):  # a miss, then a hit
        gx, gw, gb = cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, output_mask=[True, False, True]
        )
        close(gx, gx_ref)
        close(gb, gb_ref)
        assert gw is None


# --- out= --------------------------------------------------------------------------------------


def test_out_arrays_of_every_pass_are_written_and_returned():
    x, dy, w, b = problem()
    y_ref, gx_ref, gw_ref, gb_ref = torch_training(x, dy, w, b)
    out = (np.empty_like(x), np.empty(C), np.empty(C))
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None, out=out)
    assert y is out[0] and mean is out[1] and invstd is out[2]
    close(y, y_ref)
    grads = (np.empty_like(x), np.empty(C), np.empty(C))
    got = cudnn_bn.batch_norm_backward(
        x, dy, w, None, None, mode="saved", saved_mean=mean, saved_invstd=invstd, out=grads
    )
    assert all(g is o for g, o in zip(got, grads, strict=True))
    for ours, ref in zip(got, (gx_ref, gw_ref, gb_ref), strict=True):
        close(ours, ref)
    inference = np.empty_like(x)
    running_mean, running_var = np.zeros(C), np.ones(C)
    got = cudnn_bn.batch_norm_forward_inference(x, w, b, running_mean, running_var, out=inference)
    assert got is inference
    ref = F.batch_norm(*map(torch.tensor, (x, running_mean, running_var, w, b)), False)
    close(got, ref.numpy())


def test_a_training_forward_takes_its_reserve_as_out_3_and_returns_it():
    """``out[3]`` is the reserve the call fills (none on the CPU engine, which needs no
    bytes) and returns as ``.reserve``; it is checked as every written operand is, and must
    be one packed buffer. Before, ``out=`` took three arrays."""
    x, dy, w, b = problem()
    y_ref = torch_training(x, dy, w, b)[0]
    out = (np.empty_like(x), np.empty(C), np.empty(C), np.empty(8, np.uint8))
    got = cudnn_bn.batch_norm_forward_training(x, w, b, None, None, out=out)
    assert (*got, got.reserve) == out
    close(got[0], y_ref)
    y = np.full_like(x, 7.0)
    read_only = np.empty(8, np.uint8)
    read_only.flags.writeable = False
    for reserve, words in [
        (np.empty(16, np.uint8)[::2], r"BAD_TENSOR_STRIDES: out\[3\] must be one packed buffer"),
        (read_only, r"BAD_PARAM: out\[3\] is read-only"),
        (y.view(np.uint8), r"BAD_PARAM: out\[0\] and out\[3\] share memory"),
    ]:
        with pytest.raises(InfiniError, match=words):
            cudnn_bn.batch_norm_forward_training(x, w, b, None, None, out=(y, None, None, reserve))
        assert (y == 7.0).all()


def test_a_reserve_in_out_is_bytes_or_floats_and_a_refusal_says_which():
    """``out[3]`` may be uint8, int8 or a float dtype, as NumPy, torch or DLPack (the README
    says so), and a reserve of another dtype is refused saying that bytes would do. Before,
    the README said any dtype, and the refusal offered only the float dtypes."""
    x, _, w, b = problem()
    outputs = (np.empty_like(x), np.empty(C), np.empty(C))
    dlpack = NumpyDLPack(np.empty(8, np.uint8))
    for reserve in [np.empty(8, np.uint8), np.empty(8, np.int8), np.empty(2, np.float32),
                    torch.empty(8, dtype=torch.int8), dlpack]:  # fmt: skip
        got = cudnn_bn.batch_norm_forward_training(x, w, b, None, None, out=(*outputs, reserve))
        assert got.reserve is reserve
    for reserve in [np.empty(2, np.int32), torch.empty(8, dtype=torch.bool)]:
        with pytest.raises(InfiniError, match=r"^BAD_TENSOR_DTYPE: out\[3\] has .*uint8 or int8"):
            cudnn_bn.batch_norm_forward_training(x, w, b, None, None, out=(*outputs, reserve))


def test_a_partial_out_allocates_the_rest():
    x, dy, w, _ = problem()
    grad_input = np.empty_like(x)
    got = cudnn_bn.batch_norm_backward(x, dy, w, None, None, out=(grad_input, None, None))
    assert got[0] is grad_input and got[1].shape == (C,)


BAD_OUT = {
    "read-only": Status.BAD_PARAM,
    "wrong shape": Status.BAD_TENSOR_SHAPE,
    "aliases input": Status.BAD_PARAM,
    "wrong count": Status.BAD_PARAM,
    "iterates past its length": Status.BAD_PARAM,
}


class LongerThanItsLength(tuple):
    """A tuple whose iteration yields one item more than ``len`` says (found in review: the
    call counted its items with ``len`` and unpacked them by iterating, INTERNAL_ERROR)."""

    def __iter__(self):
        return iter((*tuple.__iter__(self), None))


@pytest.mark.parametrize("case", BAD_OUT)
def test_bad_out_arrays_are_refused_and_nothing_is_written(case):
    x, dy, w, _ = problem()
    grad_input, grad_weight = np.full_like(x, 7.0), np.full(C, 7.0)
    if case == "read-only":
        grad_input.flags.writeable = False
    if case == "wrong shape":
        grad_weight = np.full(C + 1, 7.0)
    if case == "aliases input":
        grad_input = dy  # grad_output is read while grad_input is written
    out = (grad_input, grad_weight) if case == "wrong count" else (grad_input, grad_weight, None)
    if case == "iterates past its length":
        out = LongerThanItsLength((*out, None))
    before = dy.copy()
    with pytest.raises(InfiniError, match=r"out|grad_weight") as caught:
        cudnn_bn.batch_norm_backward(x, dy, w, None, None, out=out)
    assert caught.value.status == BAD_OUT[case], str(caught.value)
    assert (grad_weight == 7.0).all() and np.array_equal(dy, before)
    if case != "aliases input":
        assert (grad_input == 7.0).all()


@pytest.mark.parametrize(
    ("entry", "out", "spelled"),
    [
        ("backward", lambda x, c: (None, np.ones(c + 1), None), r"out\[1\] has shape"),
        ("backward", lambda x, c: (np.ones((*x.shape[:-1], 9)), None, None), r"out\[0\] has shape"),
        ("training", lambda x, c: (None, None, np.ones(c + 1)), r"out\[2\] has shape"),
        ("inference", lambda x, c: np.ones((*x.shape[:-1], 9)), r"out has shape"),
    ],
)
def test_an_out_entry_the_operator_refuses_is_named_as_the_caller_gave_it(entry, out, spelled):
    """The door names ``out=`` entries ``out[i]``; the operators' own checks (shapes against
    the input's) once named them ``grad_weight``, ``saved_invstd``, ``output``."""
    x, dy, w, b = problem()
    given = out(x, C)
    calls = {
        "backward": lambda: cudnn_bn.batch_norm_backward(x, dy, w, None, None, out=given),
        "training": lambda: cudnn_bn.batch_norm_forward_training(x, w, b, None, None, out=given),
        "inference": lambda: cudnn_bn.batch_norm_forward_inference(
            x, w, b, np.zeros(C), np.ones(C), out=given
        ),
    }
    with pytest.raises(InfiniError, match=rf"^BAD_TENSOR_SHAPE: {spelled}"):
        calls[entry]()


def test_a_training_forwards_result_copies_and_pickles_with_its_reserve():
    """``TrainingOutputs`` takes four arguments: ``copy`` and ``pickle`` called it with the
    tuple's one and failed (found in review)."""
    x, _, w, b = problem()
    got = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    got.reserve = np.arange(4, dtype=np.uint8)  # as an NVIDIA call's would be
    for again in (copy.copy(got), copy.deepcopy(got), pickle.loads(pickle.dumps(got))):
        assert type(again) is cudnn_bn.TrainingOutputs and len(again) == 3
        for mine, theirs in zip((*again, again.reserve), (*got, got.reserve), strict=True):
            np.testing.assert_array_equal(mine, theirs)


# --- weight=None / bias=None: affine=False (finding 15) ------------------------------------


@pytest.mark.parametrize(("has_weight", "has_bias"), [(False, False), (False, True), (True, False)])
def test_absent_weight_and_bias_are_affine_false_as_torch(has_weight, has_bias):
    x, dy, w, b = problem()
    w, b = (w if has_weight else None), (b if has_bias else None)
    y_ref, gx_ref, gw_ref, _ = torch_training(x, dy, w, b)
    y, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    close(y, y_ref)
    gx, gw, _ = cudnn_bn.batch_norm_backward(
        x, dy, w, None, None, mode="saved", saved_mean=mean, saved_invstd=invstd
    )
    close(gx, gx_ref)
    assert (gw is None) == (w is None)
    if w is not None:
        close(gw, gw_ref)
    rm, rv = np.zeros(C), np.ones(C)
    ref = F.batch_norm(
        torch.tensor(x), torch.tensor(rm), torch.tensor(rv),
        None if w is None else torch.tensor(w), None if b is None else torch.tensor(b), False,
    )  # fmt: skip
    close(cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv), ref.numpy())


# --- saved statistics named as given (finding 11) ------------------------------------------


def test_errors_about_saved_statistics_name_them():
    x, dy, w, _ = problem()
    with pytest.raises(InfiniError, match="saved_invstd") as caught:
        cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, mode="saved", saved_mean=np.zeros(C), saved_invstd=np.ones(C + 1)
        )
    assert "running_var" not in str(caught.value)
    with pytest.raises(InfiniError, match="saved_mean") as caught:
        cudnn_bn.batch_norm_backward_batched(
            x[None], dy[None], w, None, None,
            mode="saved", saved_mean=np.zeros(C, np.float32), saved_invstd=np.ones(C),
        )  # fmt: skip
    assert "running_mean" not in str(caught.value)


# --- batched: one call, B = 0 validated (finding 6) ----------------------------------------


def test_batched_is_one_call_equal_to_each_problem_alone():
    xb, dyb, _, _ = problem((5, 4, C, 6))
    wb = np.random.default_rng(1).uniform(0.5, 1.5, (5, C))
    computes = []
    launcher = cudnn_bn.BatchNormBackwardDescriptor.launcher

    def counting(self, *args, **kwargs):
        launch = launcher(self, *args, **kwargs)
        counted = lambda *a: computes.append(self.tensors.input.shape) or launch.call(*a)  # noqa: E731
        return launch._replace(call=counted)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cudnn_bn.BatchNormBackwardDescriptor, "launcher", counting)
        got = cudnn_bn.batch_norm_backward_batched(xb, dyb, wb, None, None)
    assert computes == [(4, 5 * C, 6)]  # one call: the batch folded into the channels
    for i in range(5):
        _, gx, gw, gb = torch_training(xb[i], dyb[i], wb[i], np.zeros(C))
        close(got[0][i], gx)
        close(got[1][i], gw)
        close(got[2][i], gb)


@pytest.mark.parametrize("data_kind", ["torch", "numpy"])
def test_batched_takes_operands_of_numpy_and_torch_mixed_as_the_array_api_does(data_kind):
    """torch data with a NumPy weight (or the reverse), which ``batch_norm_backward`` takes:
    the batched pass once copied a NumPy weight into a torch tensor with ``[...] =`` and
    raised INTERNAL_ERROR (found by the array fuzzer)."""
    xb, dyb, _, _ = problem((2, 4, C, 3))
    w = np.random.default_rng(1).uniform(0.5, 1.5, C)
    data = (torch.tensor(xb), torch.tensor(dyb)) if data_kind == "torch" else (xb, dyb)
    reversed_w, graph_w = w[::-1].copy()[::-1], torch.tensor(w, requires_grad=True)
    weight = reversed_w if data_kind == "torch" else graph_w
    got = cudnn_bn.batch_norm_backward_batched(*data, weight, None, None)
    assert all(isinstance(g, type(data[0])) for g in got)
    for i in range(2):
        _, gx, gw, gb = torch_training(xb[i], dyb[i], w, np.zeros(C))
        close(got[0][i], gx)
        close(got[1][i], gw)
        close(got[2][i], gb)


BAD_EMPTY_BATCHES = {
    "grad_output shape": dict(grad_output=np.zeros((0, 4, C, 1))),
    "grad_output dtype": dict(grad_output=np.zeros((0, 4, C, 5), np.float32)),
    "99-channel weight": dict(weight=np.ones(99)),
    "mode": dict(mode="nonsense"),
    "eps": dict(eps=-1.0),
}


@pytest.mark.parametrize("edit", BAD_EMPTY_BATCHES.values(), ids=BAD_EMPTY_BATCHES.keys())
def test_an_empty_batch_of_problems_validates_everything(edit):
    args = dict(input=np.zeros((0, 4, C, 5)), grad_output=np.zeros((0, 4, C, 5)), weight=np.ones(C))
    options = {k: edit.pop(k) for k in ("mode", "eps") if k in edit}
    args |= edit
    with pytest.raises(InfiniError):
        cudnn_bn.batch_norm_backward_batched(
            args["input"], args["grad_output"], args["weight"], None, None, **options
        )


def test_batched_operands_of_several_kinds_are_folded_each_by_its_own_library():
    """torch input with NumPy per-channel operands (found by the fuzzer: the fold copied a
    NumPy weight into a torch tensor)."""
    xb, dyb, _, _ = problem((2, 4, C, 5))
    w = np.random.default_rng(2).uniform(0.5, 1.5, C)
    got = cudnn_bn.batch_norm_backward_batched(torch.tensor(xb), dyb, w, None, None)
    assert isinstance(got[0], torch.Tensor)
    for i in range(2):
        _, gx, gw, _ = torch_training(xb[i], dyb[i], w, np.zeros(C))
        close(got[0][i], gx)
        close(got[1][i], gw)


def test_an_empty_batch_of_problems_gives_empty_results():
    """B = 0, the problem otherwise good: empty results shaped as a batch's (found by the
    array fuzzer: the fold made a problem of no channels, which the operators refuse)."""
    x = np.zeros((0, 4, C, 5))
    gx, gw, gb = cudnn_bn.batch_norm_backward_batched(x, x, np.ones(C), None, None)
    assert gx.shape == x.shape and gw.shape == gb.shape == (0, C)
    _, gw, _ = cudnn_bn.batch_norm_backward_batched(x, x, None, None, None)
    assert gw is None


@pytest.mark.parametrize("name", ["input", "weight"])
def test_batched_alignment_is_checked_on_every_call(name):
    """A repeated batched problem reuses its fold: an operand the fold copies (a shared
    weight, contiguous data) is not seen by the backward's own checks, so the fold checks
    the addresses itself (found by the array fuzzer)."""
    xb, dyb, _, _ = problem((3, 4, C, 5))
    w = np.ones(C)
    operands = {"input": xb, "weight": w}
    cudnn_bn.batch_norm_backward_batched(xb, dyb, w, None, None)  # the fold: aligned
    good = operands[name]
    raw = np.zeros(good.nbytes + 1, np.uint8)
    shifted = np.frombuffer(raw.data, np.float64, good.size, offset=1).reshape(good.shape)
    assert shifted.strides == good.strides and not shifted.flags.aligned
    operands[name] = shifted
    with pytest.raises(InfiniError, match=rf"{name}'s data .* not aligned"):
        cudnn_bn.batch_norm_backward_batched(operands["input"], dyb, operands["weight"], None, None)


def test_batched_reads_a_resolved_view_while_it_is_alive():
    """NumPy data with a torch grad_output that has the negative bit: the door reads it
    through a resolved copy, which the fold must keep alive while it folds and computes
    (found by the array fuzzer: the copy was freed first, and garbage was read)."""
    rng = np.random.default_rng(0)
    for shape in [(1, 2, 1), (2, 3, 2), (3, 5, 3)]:
        x = rng.standard_normal(shape).astype(np.float32)
        base = torch.from_numpy(rng.standard_normal((*shape, 2)).astype(np.float32))
        dy = torch._neg_view(base[..., 1])
        assert dy.is_neg()
        w = np.ones(shape[2], np.float32)
        got = cudnn_bn.batch_norm_backward_batched(x, dy, w, None, None)
        want = cudnn_bn.batch_norm_backward_batched(x, dy.resolve_neg().numpy(), w, None, None)
        for g, h in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), h, rtol=1e-6, atol=1e-7)


def test_a_plain_torch_tensor_without_storage_is_refused_by_name():
    """Inside ``torch.vmap`` an argument is a plain ``torch.Tensor`` with no storage: the
    attribute read must hand it to the door, which names it (not an INTERNAL_ERROR)."""
    x, _, w, b = problem()
    w, b, rm, rv = (torch.tensor(a) for a in (w, b, np.zeros(C), np.ones(C)))

    def forward(xi: torch.Tensor) -> torch.Tensor:
        return cudnn_bn.batch_norm_forward_inference(xi, w, b, rm, rv)

    with pytest.raises(InfiniError, match="input is a tensor without strided storage") as info:
        torch.vmap(forward)(torch.tensor(x)[None])
    assert info.value.status == Status.BAD_PARAM


def test_a_plans_descriptor_is_neither_changed_nor_destroyed():
    """A cached descriptor is public (``descriptor_cache.descriptors()``), and a plan runs its
    build without a lease: changing or destroying it would have a hit run the old build (the
    old eps; after destroy a closed kernel, cuDNN's destroyed descriptors on NVIDIA) with no
    error. Both are refused, and the plan goes on computing right (found in review)."""
    x, _, w, b = problem()
    rm, rv = np.zeros(C), np.ones(C)
    cudnn_bn.descriptor_cache.clear()
    try:
        cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)
        (desc,) = cudnn_bn.descriptor_cache.descriptors()
        for change in (lambda: desc.set_attributes(eps=0.5), desc.destroy):
            with pytest.raises(InfiniError, match="plan cache, which runs it") as caught:
                change()
            assert caught.value.status == Status.BAD_PARAM
        got = cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)
        want = F.batch_norm(*map(torch.tensor, (x, rm, rv, w, b)), False, 0.0, 1e-5)
        close(got, want.numpy())
    finally:
        cudnn_bn.descriptor_cache.clear()
