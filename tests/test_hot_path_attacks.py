"""A plan's hit against the door's miss on host arrays (review 8 of issue 17's hot path):
each accepts what the other accepts and names the argument the other names. An array with
no elements has no byte, so it overlaps nothing wherever its pointer lies, as in PyTorch's
``get_overlap_status`` (aten/src/ATen/MemoryOverlap.cpp)."""

import re

import numpy as np
import pytest
from producers import HostTurning

import cudnn_bn
from cudnn_bn import InfiniError

C = 3


def _inside(buffer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """An array of ``shape`` with no elements whose address lies inside ``buffer``'s bytes
    (one element in), as slicing a preallocated arena gives."""
    return np.lib.stride_tricks.as_strided(buffer[1:], shape, (120, 40, 8))


def _twice(call) -> list:
    """``call()`` on a miss (new plan), then on a hit of that plan."""
    cudnn_bn.descriptor_cache.clear()
    return [call(), call()]


def test_an_empty_output_inside_another_operand_is_accepted():
    arena = np.ones(64)
    w, b, mean, var = arena[0:3], arena[8:11], arena[16:19], arena[24:27]
    x = np.ones((0, C, 5))
    out = _inside(w, x.shape)
    assert out.size == 0 and w.ctypes.data < out.ctypes.data < w.ctypes.data + w.nbytes
    for y in _twice(lambda: cudnn_bn.batch_norm_forward_inference(x, w, b, mean, var, out=out)):
        assert y is out
    grads = _twice(
        lambda: cudnn_bn.batch_norm_backward(x, x, w, mean, var, mode="eval", out=(out, None, None))
    )
    assert all(g[0] is out for g in grads)


def test_an_empty_input_inside_a_written_gradient_is_accepted():
    gw_arena = np.zeros(8)
    gw = gw_arena[:C]
    x = _inside(gw, (0, C, 5))
    w, mean, var = np.ones(C), np.zeros(C), np.ones(C)
    for _, grad_weight, _ in _twice(
        lambda: cudnn_bn.batch_norm_backward(x, x, w, mean, var, mode="eval", out=(None, gw, None))
    ):
        assert grad_weight is gw
    np.testing.assert_array_equal(gw, 0.0)  # torch: the sum over no values


def _misaligned(like: np.ndarray, bad: bool) -> np.ndarray:
    """A new array like ``like``, one byte off its alignment where ``bad``."""
    raw = np.zeros(like.nbytes + 1, np.uint8)
    offset = 1 if bad else 0
    return np.frombuffer(raw.data, like.dtype, like.size, offset=offset).reshape(like.shape)


def _two_misaligned(bad: bool) -> None:
    """F16 data, F32 parameters: ``weight`` and ``out``, of two item sizes, misaligned."""
    x, w = np.ones((2, C, 4), np.float16), np.ones(C, np.float32)
    out = _misaligned(x, bad)
    cudnn_bn.batch_norm_forward_inference(x, _misaligned(w, bad), w, w, w, out=out)


def _two_overlaps(bad: bool) -> None:
    """A fused training forward whose ``running_mean`` overlaps ``z`` (read) and
    ``out[1]`` (written)."""
    x, w = np.ones((2, C, 4), np.float32), np.ones(C, np.float32)
    arena = np.zeros(64, np.float32)
    mean = arena[0:3] if bad else arena[30:33]
    out = (np.empty_like(x), arena[1:4], np.empty_like(w))
    z = (arena[2:26] if bad else arena[4:28]).reshape(x.shape)
    cudnn_bn.batch_norm_forward_training(
        x, w, w, mean, arena[40:43], fusion="add_relu", z=z, out=out
    )


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (_two_misaligned, "weight's data"),
        (_two_overlaps, "running_mean and out[1] share memory"),
    ],
)
def test_a_hit_names_the_argument_a_miss_names(call, named):
    """Where two arguments are wrong, a hit names the one the door names on a miss: the
    first in the pass's order (for an overlap: a written one against those written after
    it, then those read), whatever their item sizes."""
    cudnn_bn.descriptor_cache.clear()
    with pytest.raises(InfiniError, match=re.escape(named)):
        call(bad=True)  # a miss
    call(bad=False)  # the plan
    with pytest.raises(InfiniError, match=re.escape(named)):
        call(bad=True)  # a hit


@pytest.mark.parametrize("shift", [-C, -(C - 1), C - 1, C])
def test_running_statistics_one_element_apart_on_a_hit(shift):
    """``running_var`` ``shift`` elements after ``running_mean`` in one buffer: sharing one
    element at either end is refused, touching is not, on a hit as on a miss (the inline
    test's bounds are strict and exact)."""
    x, w = np.ones((2, C, 4)), np.ones(C)
    cudnn_bn.batch_norm_forward_training(x, w, w, np.zeros(C), np.ones(C))  # the plan
    buffer = np.zeros(3 * C)
    mean = buffer[C : 2 * C]
    var = buffer[C + shift : 2 * C + shift]
    if abs(shift) == C:
        cudnn_bn.batch_norm_forward_training(x, w, w, mean, var)
        return
    with pytest.raises(InfiniError, match="running_mean and running_var share memory"):
        cudnn_bn.batch_norm_forward_training(x, w, w, mean, var)
    assert not buffer.any()


@pytest.mark.parametrize(("dtype", "offset"), [(np.float64, 4), (np.float64, 2), (np.float32, 2)])
def test_an_address_off_by_part_of_an_element_is_refused_on_a_hit(dtype, offset):
    """Every low bit of the item size counts, not only the lowest one."""
    x = np.ones((2, C, 4), dtype)
    cudnn_bn.batch_norm_backward(x, x, np.ones(C, dtype), None, None)  # the plan
    raw = np.zeros(x.nbytes + offset, np.uint8)
    shifted = np.frombuffer(raw.data, dtype, x.size, offset=offset).reshape(x.shape)
    assert shifted.strides == x.strides and not shifted.flags.aligned
    with pytest.raises(InfiniError, match=r"grad_output's data .* not aligned"):
        cudnn_bn.batch_norm_backward(x, shifted, np.ones(C, dtype), None, None)


class _Stream:
    """A stream object as CuPy's and torch's are read: its address as ``ptr``."""

    ptr = 7


class _At:
    """A stream object whose address is ``ptr`` (CuPy's attribute)."""

    def __init__(self, ptr: object) -> None:
        self.ptr = ptr


class _Protocol:
    """A stream object whose ``__cuda_stream__()`` (the CUDA stream protocol) returns
    ``result``."""

    def __init__(self, result: object) -> None:
        self.result = result

    def __cuda_stream__(self) -> object:
        return self.result


class _TorchLike:
    """A stream object whose address is ``cuda_stream`` (torch's attribute)."""

    cuda_stream = -3


# Stream objects whose address is no cudaStream_t (an int from 0 to 2**64 - 1), or whose
# protocol method returns no (version, address) pair: each was INTERNAL_ERROR (int() of a
# string or None, a non-tuple indexed) or taken (an address of -1, 2**64, 1.5, True).
_BAD_STREAM_OBJECTS = {
    "ptr-str": _At("a"), "ptr-None": _At(None), "ptr--1": _At(-1), "ptr-2**64": _At(1 << 64),
    "ptr-float": _At(1.5), "ptr-bool": _At(True), "cuda_stream--3": _TorchLike(),
    "protocol-int": _Protocol(5), "protocol-()": _Protocol(()), "protocol-str": _Protocol((0, "a")),
    "protocol--1": _Protocol((0, -1)), "protocol-2**70": _Protocol((0, 1 << 70)),
}  # fmt: skip


@pytest.mark.parametrize(
    "stream",
    ["a", True, -1, 1 << 64, 1.5, object(), *_BAD_STREAM_OBJECTS.values()],
    ids=["str", "bool", "-1", "2**64", "float", "object", *_BAD_STREAM_OBJECTS],
)
def test_what_is_no_stream_is_refused_with_host_arrays_on_a_miss_and_a_hit(stream):
    """Host arrays run on no stream, and code written for both may pass one; what is no
    stream at all is BAD_PARAM naming ``stream`` (as on a device), and nothing is written.
    It was taken and ignored, on a miss and a hit; a stream object's address is checked as
    an int stream is (found by an outsider's attack: session 9's check took any object's
    ``ptr``)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, C, 5))
    w, b, mean, var = np.ones(C), np.zeros(C), np.zeros(C), np.ones(C)
    calls = {
        "training": lambda s: cudnn_bn.batch_norm_forward_training(x, w, b, mean, var, stream=s),
        "inference": lambda s: cudnn_bn.batch_norm_forward_inference(x, w, b, mean, var, stream=s),
        "backward": lambda s: cudnn_bn.batch_norm_backward(x, x, w, None, None, stream=s),
        "batched": lambda s: cudnn_bn.batch_norm_backward_batched(
            x[None], x[None], w, None, None, stream=s
        ),
    }
    for name, call in calls.items():
        for hit in (False, True):
            cudnn_bn.descriptor_cache.clear()
            if hit:
                call(None)
            before = mean.copy(), var.copy()
            with pytest.raises(InfiniError, match="stream") as caught:
                call(stream)
            assert caught.value.status == cudnn_bn.Status.BAD_PARAM, (name, hit)
            assert np.array_equal(mean, before[0]) and np.array_equal(var, before[1]), name


def test_a_stream_given_with_host_arrays_is_taken_and_changes_nothing():
    """An int in [0, 2**64) or a stream object is a stream: a host call given one runs as
    given none."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, C, 5))
    w = np.ones(C)
    want = cudnn_bn.batch_norm_backward(x, x, w, None, None)
    for stream in (0, 7, (1 << 64) - 1, _Stream()):
        for got, expected in zip(
            cudnn_bn.batch_norm_backward(x, x, w, None, None, stream=stream), want, strict=True
        ):
            np.testing.assert_array_equal(got, expected)


def test_a_type_error_raised_while_a_plan_is_looked_up_is_not_an_unhashable_option(
    monkeypatch,
):
    """A TypeError raised while the plan's key is looked up (a signal handler's, landing
    there) passes through: it was taken for an unhashable option and became BAD_PARAM
    'unhashable option among ...' (found by an outsider's timer-driven attack, 1 to 4 calls
    in 50). Only a key that does not hash is an unhashable option."""
    x = np.ones((4, C, 5))
    cache = cudnn_bn.api.call.descriptor_cache
    raised = TypeError("the caller's signal handler")

    def interrupted(key):
        raise raised

    monkeypatch.setattr(cache, "get", interrupted)
    with pytest.raises(TypeError) as caught:
        cudnn_bn.batch_norm_backward(x, x, np.ones(C), None, None)
    assert caught.value is raised


# What a turning ``running_mean`` (``HostTurning``) says from its k-th read on, over ``arena``
# (its first read: 3 float64 at element 4): valid (another buffer, a strided view) or not.
_HOST_TURNS = {
    "pointer": lambda at, iface: iface | {"data": (at(16), False)},
    "shape": lambda at, iface: iface | {"shape": (C + 1,)},
    "strides": lambda at, iface: iface | {"strides": (16,)},
    "typestr": lambda at, iface: iface | {"typestr": "<f4"},
    "read_only": lambda at, iface: iface | {"data": (at(4), True)},
    "mask": lambda at, iface: iface | {"mask": np.ones(C)},
}


@pytest.mark.parametrize("planned", [False, True], ids=["new", "planned"])
@pytest.mark.parametrize("k", range(1, 5))
@pytest.mark.parametrize("turn", _HOST_TURNS)
def test_an_array_interface_is_read_once_per_call_and_the_call_runs_on_that_read(turn, k, planned):
    """A written ``__array_interface__`` whose dict changes from read ``k`` on (another
    pointer, shape, strides, typestr, read-only flag, a mask) is read once per call, and
    the call does exactly what it does for a producer that always says what that read said:
    refused naming it, or written where that read described. The door read it 3 times on a
    plan's hit and 4 on a new problem (presence tests, the place, the description), so one
    read could be checked and another used."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, C, 5))
    w, b = np.ones(C), np.zeros(C)
    arena = np.zeros(32)
    at = lambda i: arena[i:].ctypes.data  # noqa: E731
    first = {"version": 3, "shape": (C,), "typestr": "<f8", "data": (at(4), False)}
    then = _HOST_TURNS[turn](at, first)

    def attempt(producer: HostTurning) -> tuple:
        """The call's error, or what it wrote, in the cache state ``planned`` says."""
        cudnn_bn.descriptor_cache.clear()
        if planned:
            cudnn_bn.batch_norm_forward_training(x, w, b, HostTurning(first, first, 1), None)
        arena[:] = 0
        try:
            cudnn_bn.batch_norm_forward_training(x, w, b, producer, None)
        except InfiniError as error:
            assert "running_mean" in str(error) and not arena.any()
            return type(error), str(error)
        assert arena.any()
        return (arena.copy(),)

    attacker = HostTurning(first, then, k)
    got = attempt(attacker)
    assert attacker.reads == 1
    honest = first if k > 1 else then
    want = attempt(HostTurning(honest, honest, 1))
    assert len(got) == len(want) and all(map(np.array_equal, got, want))
