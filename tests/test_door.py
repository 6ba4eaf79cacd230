"""Every producer through one door (issue 16): lying and odd producers are refused by name,
views are resolved or refused, allocation follows the producer's kind, and nothing the
caller owns is written when a call fails. References: NumPy's array interface protocol
(v3), DLPack 1.0 (``dlpack.h``), torch's own reading of its tensors (``resolve_neg``)."""

import ctypes
import json
import os
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from producers import (  # DLPack structs written out from dlpack.h v1.0; producers
    IS_COPIED,
    READ_ONLY,
    CudaInterface,
    DLDataType,
    DLDevice,
    DLManagedTensorVersioned,
    DLTensor,
    HostTurning,
    LyingArray,
    LyingTensor,
    NumpyDLPack,
    new_capsule,
)

import cudnn_bn
from cudnn_bn import InfiniError, Status

C = 3


def problem(dtype=np.float64, shape=(4, C, 5)):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.5, 1.5, shape[1]).astype(dtype)
    b = rng.standard_normal(shape[1]).astype(dtype)
    return x, dy, w, b


class Interface:
    """Any object exposing ``__array_interface__`` (NumPy's protocol): the dict as given."""

    def __init__(self, **iface):
        self.__array_interface__ = {"version": 3, **iface}


def torch_backward(x, dy, w):
    """grad_input, grad_weight, grad_bias of training batch norm by torch in float64."""
    xt = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    wt = torch.tensor(np.asarray(w, np.float64), requires_grad=True)
    bt = torch.zeros(w.shape[0], dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.batch_norm(xt, None, None, wt, bt, True, 0.1, 1e-5)
    y.backward(torch.tensor(np.asarray(dy, np.float64)))
    return xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy()


# --- finding 1: buffer objects as __array_interface__ data -----------------------------------


def test_a_buffer_smaller_than_its_shape_is_refused_not_read():
    """NumPy's spec lets ``data`` be any buffer; a 2-byte one once became address 0x01."""
    x, dy, w, _ = problem()
    lying = Interface(shape=x.shape, typestr="<f8", data=bytearray(2))
    with pytest.raises(InfiniError) as caught:
        cudnn_bn.batch_norm_backward(lying, dy, w, None, None)
    assert caught.value.status == Status.BAD_TENSOR_STRIDES
    assert "input" in str(caught.value) and "2-byte buffer" in str(caught.value)


@pytest.mark.parametrize("data", ["bytearray", "memoryview", "bytes", "None"])
def test_buffer_data_is_read_from_the_buffer(data):
    x, dy, w, _ = problem()
    raw = x.tobytes()
    buffers = {"bytearray": bytearray(raw), "memoryview": memoryview(bytearray(raw)), "bytes": raw}

    class OwnBuffer(bytearray):  # data None: the object's own buffer
        @property
        def __array_interface__(self):
            return {"version": 3, "shape": x.shape, "typestr": "<f8", "data": None}

    source = (
        OwnBuffer(raw)
        if data == "None"
        else Interface(shape=x.shape, typestr="<f8", data=buffers[data])
    )
    got = cudnn_bn.batch_norm_backward(source, dy, w, None, None)
    for ours, ref in zip(got, torch_backward(x, dy, w), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)


def test_a_numpy_integer_offset_is_read_as_numpy_reads_it():
    """NumPy takes any integer ``offset`` into a buffer (``np.int64(8)`` included, as a
    producer computing it with NumPy makes it); one was refused as "outside its buffer"."""
    x, dy, w, _ = problem()
    padded = np.concatenate([[0.0], x.ravel()]).tobytes()
    source = Interface(shape=x.shape, typestr="<f8", data=padded, offset=np.int64(8))
    np.testing.assert_array_equal(np.asarray(source), x)  # NumPy's own reading
    got = cudnn_bn.batch_norm_backward(source, dy, w, None, None)
    for ours, ref in zip(got, torch_backward(x, dy, w), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-12)
    for offset, words in ((0.5, "not an integer"), (True, "not an integer"), (-8, "outside")):
        lying = Interface(shape=x.shape, typestr="<f8", data=padded, offset=offset)
        with pytest.raises(InfiniError, match=words) as caught:
            cudnn_bn.batch_norm_backward(lying, dy, w, None, None)
        assert caught.value.status == Status.BAD_PARAM and "input" in str(caught.value)


def test_a_read_only_buffer_is_not_written():
    x, _, w, b = problem()
    frozen = Interface(shape=(C,), typestr="<f8", data=np.zeros(C).tobytes())
    with pytest.raises(InfiniError, match="running_mean is read-only") as caught:
        cudnn_bn.batch_norm_forward_training(x, w, b, frozen, None)
    assert caught.value.status == Status.BAD_PARAM


# --- finding 13: malformed interfaces are the caller's error, named ----------------------------

DATA = {"shape": (4, C, 5), "typestr": "<f8", "data": (8, False)}
MALFORMED = {
    "no shape": ({"typestr": "<f8", "data": (8, False)}, Status.BAD_PARAM, "no 'shape'"),
    "bad typestr": (DATA | {"typestr": "zz"}, Status.BAD_TENSOR_DTYPE, "typestr"),
    "short strides": (DATA | {"strides": (8,)}, Status.BAD_TENSOR_STRIDES, "1 strides for 3"),
    "negative size": (DATA | {"shape": (-4, C, 5)}, Status.BAD_TENSOR_SHAPE, "outside"),
    "mask": (DATA | {"mask": np.ones(1)}, Status.BAD_PARAM, "mask"),
    "data of the wrong form": (DATA | {"data": (8,)}, Status.BAD_PARAM, "data"),
    "not a dict": (None, Status.BAD_PARAM, "wants a dict"),
    "zero stride, 2**63 values": (
        DATA | {"shape": (1 << 62, C, 4), "strides": (0, 0, 0)},
        Status.BAD_TENSOR_SHAPE,
        "more bytes",
    ),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_array_interfaces_are_refused_naming_the_argument(case):
    iface, status, words = case
    _, dy, w, _ = problem()
    lying = Interface(**iface) if iface is not None else Interface()
    if iface is None:
        lying.__array_interface__ = ["not", "a", "dict"]
    with pytest.raises(InfiniError) as caught:
        cudnn_bn.batch_norm_backward(dy, lying, w, None, None)
    assert caught.value.status == status, str(caught.value)
    assert "grad_output" in str(caught.value) and words in str(caught.value)


def test_an_array_with_elements_at_address_0_is_refused_in_words_its_api_uses():
    """The door says where the elements are; the array API's renaming of the C API's words
    (``NULL`` -> ``None``) turned its message into "... elements at None"."""
    _, dy, w, _ = problem()
    null = Interface(shape=dy.shape, typestr=dy.dtype.str, data=(0, False))
    with pytest.raises(InfiniError) as caught:
        cudnn_bn.batch_norm_backward(dy, null, w, None, None)
    assert caught.value.status == Status.NULL_POINTER, str(caught.value)
    assert f"grad_output has {dy.size} elements at address 0" in str(caught.value)


def test_a_typestr_that_is_not_a_string_is_refused():
    """``np.dtype(None)`` is float64: a typestr of None was read as "<f8" whatever the
    data held (found by the array fuzzer). The protocol's typestr is a string."""
    x, dy, w, _ = problem()
    lying = Interface(shape=dy.shape, typestr=None, data=(dy.ctypes.data, False))
    with pytest.raises(InfiniError, match=r"grad_output.*typestr None") as caught:
        cudnn_bn.batch_norm_backward(x, lying, w, None, None)
    assert caught.value.status == Status.BAD_TENSOR_DTYPE


def test_torch_sparse_and_nested_tensors_are_refused_naming_them():
    x, dy, w, _ = problem()
    sparse = torch.tensor(dy).to_sparse()
    with pytest.raises(InfiniError, match=r"grad_output has layout torch\.sparse_coo") as caught:
        cudnn_bn.batch_norm_backward(torch.tensor(x), sparse, torch.tensor(w), None, None)
    assert caught.value.status == Status.BAD_PARAM
    nested = torch.nested.nested_tensor([torch.tensor(x[0]), torch.tensor(x[1])])
    with pytest.raises(InfiniError, match="input is a nested tensor"):
        cudnn_bn.batch_norm_forward_inference(nested, None, None, None, None)


def test_a_callers_own_exception_passes_through_unchanged():
    """A signal handler's TimeoutError raised while the call runs is the caller's: not an
    INTERNAL_ERROR."""

    class Slow:
        @property
        def __array_interface__(self):
            signal.raise_signal(signal.SIGALRM)
            return {}

    def handler(signum, frame):
        raise TimeoutError("the caller's deadline")

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with pytest.raises(TimeoutError, match="the caller's deadline"):
            cudnn_bn.batch_norm_backward(Slow(), Slow(), None, None, None)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_callers_own_exception_from_python_c_passes_through_unchanged():
    """The same from code run as ``python -c`` (or typed at a REPL or in a notebook: its
    file is "<string>", "<stdin>", "<ipython-input-...>"): it was INTERNAL_ERROR
    "unexpected TimeoutError" (found by an outsider's attack)."""
    script = """
import signal
import cudnn_bn

class Slow:
    @property
    def __array_interface__(self):
        signal.raise_signal(signal.SIGALRM)

def handler(signum, frame):
    raise TimeoutError("the caller's deadline")

signal.signal(signal.SIGALRM, handler)
try:
    cudnn_bn.batch_norm_backward(Slow(), Slow(), None, None, None)
except TimeoutError as exc:
    print(exc)
"""
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout == "the caller's deadline\n"


def test_a_callers_own_exception_raised_in_a_library_it_calls_passes_through_unchanged():
    """A producer's own method that calls the standard library (or any library), which
    raises: the caller's code raised it, though the innermost frame is the library's. It
    was INTERNAL_ERROR "unexpected JSONDecodeError" (found by an outsider's attack)."""

    class Garbled:
        @property
        def __array_interface__(self):
            return json.loads("{not json")

    with pytest.raises(json.JSONDecodeError):
        cudnn_bn.batch_norm_backward(Garbled(), Garbled(), None, None, None)


_LIBRARY_HANDLER_SCRIPT = """
import fnmatch, os, random, signal
import numpy as np
import cudnn_bn

package = os.path.dirname(cudnn_bn.__file__)
x, w = np.ones((2, 3, 4)), np.ones(3)
signal.signal(signal.SIGALRM, fnmatch.fnmatch)  # fnmatch(signum, frame): TypeError, raised
inside = wrapped = 0                             # in the standard library (posixpath)


def settle():  # a Python call: a signal pending since the timer was cleared is handled here
    pass


for _ in range(20000):
    try:
        signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-6, 1e-4))
        cudnn_bn.batch_norm_backward(x, x, w, None, None)
        signal.setitimer(signal.ITIMER_REAL, 0)
        settle()
    except TypeError as exc:
        tb, files = exc.__traceback__, []
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        inside += any(f.startswith(package) for f in files)
    except cudnn_bn.InfiniError as exc:
        wrapped += 1
        print(exc)
    if inside >= 50:
        break
print(inside, wrapped)
"""


def test_a_signal_handler_from_a_library_raises_through_unchanged():
    """A signal handler defined in a library (a timeout decorator's in site-packages; here
    a standard-library function installed as one, which raises TypeError) raising while
    the package's code runs: the caller installed it, so its exception passes through. The
    innermost frames being a library's, called from the package's, made it INTERNAL_ERROR
    "unexpected TypeError" (found by an outsider's attack)."""
    child = subprocess.run(
        [sys.executable, "-c", _LIBRARY_HANDLER_SCRIPT], capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    inside, wrapped = map(int, child.stdout.split()[-2:])
    assert (inside, wrapped) == (50, 0), child.stdout[-3000:]


# --- finding 4: byte order, every dtype --------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_big_endian_input_is_refused_for_every_dtype(dtype):
    x, dy, _, _ = problem(np.float32)
    swapped = x.astype(np.dtype(dtype).newbyteorder(">"))
    assert not swapped.dtype.isnative
    with pytest.raises(InfiniError, match=r"input has dtype .* non-native byte order") as caught:
        cudnn_bn.batch_norm_backward(swapped, dy.astype(dtype), None, None, None)
    assert caught.value.status == Status.BAD_TENSOR_DTYPE


def test_big_endian_output_is_refused_and_not_written():
    x, _, w, b = problem(np.float32)
    running = np.zeros(C, np.dtype(np.float32).newbyteorder(">"))
    with pytest.raises(InfiniError, match="running_mean has dtype >f4"):
        cudnn_bn.batch_norm_forward_training(x, w, b, running, None)
    assert not running.any()


# --- finding 3: torch's negative and conjugate bits ----------------------------------------


def negative_view(values: np.ndarray) -> torch.Tensor:
    """``values`` as a torch view with the negative bit set (``z.conj().imag``)."""
    z = torch.complex(torch.zeros(values.shape, dtype=torch.float64), -torch.tensor(values))
    view = z.conj().imag
    assert view.is_neg() and torch.equal(view, torch.tensor(values))
    return view


def test_inputs_with_the_negative_bit_are_read_as_torch_reads_them():
    x, dy, w, _ = problem()
    got = cudnn_bn.batch_norm_backward(
        negative_view(x), negative_view(dy), torch.tensor(w), None, None
    )
    for ours, ref in zip(got, torch_backward(x, dy, w), strict=True):
        np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-10, atol=1e-12)


def test_a_written_operand_with_the_negative_bit_is_refused_and_not_written():
    x, _, w, b = problem()
    running = negative_view(np.ones(C))
    with pytest.raises(
        InfiniError, match="running_var is a torch view with the negative bit"
    ) as caught:
        cudnn_bn.batch_norm_forward_training(
            torch.tensor(x), torch.tensor(w), torch.tensor(b), None, running
        )
    assert caught.value.status == Status.BAD_PARAM
    assert torch.equal(running, torch.ones(C, dtype=torch.float64))


# --- finding 12: outputs follow the producer's place and kind -----------------------------------


class Subclass(torch.Tensor):
    """A user's subclass of torch.Tensor."""


def test_cpu_dlpack_producers_get_numpy_outputs():
    x, dy, w, _ = problem()
    got = cudnn_bn.batch_norm_backward(NumpyDLPack(x), NumpyDLPack(dy), w, None, None)
    assert all(type(g) is np.ndarray for g in got)
    np.testing.assert_allclose(got[0], torch_backward(x, dy, w)[0], rtol=1e-10, atol=1e-12)


def test_torch_subclasses_get_torch_outputs():
    x, dy, w, _ = problem()
    sub = torch.tensor(x).as_subclass(Subclass)
    got = cudnn_bn.batch_norm_backward(sub, torch.tensor(dy), torch.tensor(w), None, None)
    assert all(isinstance(g, torch.Tensor) for g in got)
    np.testing.assert_allclose(got[0].numpy(), torch_backward(x, dy, w)[0], rtol=1e-10, atol=1e-12)


def test_fold_conv_bn_takes_a_numpy_matrix_as_the_array_it_holds():
    """``np.matrix``'s ``*`` is a matrix product: folding a 2-D matrix weight once raised
    INTERNAL_ERROR (found by the array fuzzer)."""
    rng = np.random.default_rng(5)
    weight, mean, var = rng.standard_normal((4, C)), rng.standard_normal(C), np.ones(C)
    bn_weight, bn_bias = rng.uniform(0.5, 1.5, C), rng.standard_normal(C)
    want = cudnn_bn.fold_conv_bn(weight, None, bn_weight, bn_bias, mean, var, 1e-5, transpose=True)
    got = cudnn_bn.fold_conv_bn(
        np.asmatrix(weight), None, bn_weight, bn_bias, mean, var, 1e-5, transpose=True
    )
    for ours, ref in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-12)


# --- DLPack 1.0: flags and lifetime (issue 19, finding 6) -----------------------------------


class Versioned:
    """A DLPack 1.0 producer of ``array``'s memory with ``flags``; counts live exports."""

    def __init__(self, array: np.ndarray, flags: int = 0):
        self.array, self.flags, self.kwargs = array, flags, []
        self._shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self._managed = DLManagedTensorVersioned(
            1, 0, None, None, flags,
            DLTensor(
                data=array.ctypes.data, device=DLDevice(1, 0), ndim=array.ndim,
                dtype=DLDataType(2, 64, 1), shape=self._shape,
            ),
        )  # fmt: skip

    def __dlpack_device__(self):
        return 1, 0

    def __dlpack__(self, *, stream=None, max_version=None, copy=None):
        self.kwargs.append(dict(stream=stream, max_version=max_version, copy=copy))
        return new_capsule(ctypes.addressof(self._managed), b"dltensor_versioned", None)


def test_dlpack_1_0_capsules_are_read_and_flags_honoured():
    x, dy, w, b = problem()
    got = cudnn_bn.batch_norm_backward(Versioned(x), Versioned(dy, READ_ONLY), w, None, None)
    np.testing.assert_allclose(got[0], torch_backward(x, dy, w)[0], rtol=1e-10, atol=1e-12)
    for flag, words in ((READ_ONLY, "marked read-only"), (IS_COPIED, "a copy its DLPack producer")):
        running = Versioned(np.zeros(C), flag)
        with pytest.raises(InfiniError, match=f"running_mean is {words}"):
            cudnn_bn.batch_norm_forward_training(x, w, b, running, None)
        assert not running.array.any()
        assert running.kwargs[-1]["copy"] is False  # written: the producer is asked not to copy


def test_a_capsule_on_another_device_than_its_producer_says_is_refused():
    """``__dlpack_device__`` said CPU, the capsule CUDA: the call on the CPU once read the
    capsule's pointer (device memory, on a GPU machine) with its host kernels (found by the
    array fuzzer)."""
    x, dy, w, _ = problem()
    lying = Versioned(dy)
    lying._managed.dl_tensor.device.device_type = 2  # kDLCUDA
    with pytest.raises(InfiniError, match="grad_output") as caught:
        cudnn_bn.batch_norm_backward(x, lying, w, None, None)
    assert caught.value.status == Status.BAD_PARAM
    assert "__dlpack_device__" in str(caught.value)


def test_a_dlpack_producer_is_asked_its_device_once_per_call():
    """``__dlpack_device__()`` was called 3 times for a new problem (the place, the check of
    the capsule against it, the plan's place) and twice on a plan's hit, so the capsule
    could be checked against another answer than the one the call was planned for. It is
    asked once, and exported once."""

    class Counting(Versioned):
        asked = 0

        def __dlpack_device__(self):
            self.asked += 1
            return super().__dlpack_device__()

    x, dy, w, _ = problem()
    cudnn_bn.descriptor_cache.clear()
    for _ in ("new", "planned"):
        producer = Counting(x)
        cudnn_bn.batch_norm_backward(producer, dy, w, None, None)
        assert producer.asked == 1 and len(producer.kwargs) == 1


def test_a_producer_that_must_copy_a_written_operand_is_refused():
    x, _, w, b = problem()

    class CopyOnly(Versioned):
        def __dlpack__(self, *, stream=None, max_version=None, copy=None):
            if copy is False:
                raise BufferError("this producer only exports copies")
            return super().__dlpack__(stream=stream, max_version=max_version, copy=copy)

    with pytest.raises(InfiniError, match="running_var is written in place but its DLPack"):
        cudnn_bn.batch_norm_forward_training(x, w, b, None, CopyOnly(np.ones(C)))


def test_a_buffer_error_exporting_a_read_operand_is_not_called_a_copy_refusal():
    """A producer's BufferError for an operand the call only reads was reported as "written
    in place but its DLPack producer can only export a copy": the operand is not written and
    ``copy=False`` was not asked. The caller's own producer's exception passes through
    unchanged (as every other exception of its methods); a library's is BAD_PARAM naming
    the operand, in words that say what failed."""
    _, dy, w, _ = problem()

    class Refusing:
        def __dlpack_device__(self):
            return 1, 0

        def __dlpack__(self, **kwargs):
            raise BufferError("cannot export this one")

    with pytest.raises(BufferError) as raised:
        cudnn_bn.batch_norm_backward(Refusing(), dy, w, None, None)
    assert type(raised.value) is BufferError and str(raised.value) == "cannot export this one"

    class Structured:  # NumPy's own __dlpack__ (compiled) refuses a structured dtype
        def __init__(self):
            self.array = np.zeros(dy.shape, [("a", "<f8")])
            self.__dlpack__ = self.array.__dlpack__
            self.__dlpack_device__ = self.array.__dlpack_device__

    with pytest.raises(InfiniError, match="input's DLPack producer") as caught:
        cudnn_bn.batch_norm_backward(Structured(), dy, w, None, None)
    assert caught.value.status == Status.BAD_PARAM
    assert "written in place" not in str(caught.value)


def test_the_capsule_stays_alive_until_the_call_is_done():
    """A producer that exports a copy frees it when the capsule goes (here: scribbles NaN
    over it), so the call must have read it by then; the capsule was once dropped before
    the kernels ran."""
    x, dy, w, _ = problem()

    class Exporter:
        def __dlpack_device__(self):
            return 1, 0

        def __dlpack__(self, **kwargs):
            copy = x.copy()
            view = copy[...]  # lives only as long as the capsule that holds it
            capsule = view.__dlpack__()
            weakref.finalize(view, copy.fill, np.nan)
            return capsule

    got = cudnn_bn.batch_norm_backward(Exporter(), dy, w, None, None)
    np.testing.assert_allclose(got[0], torch_backward(x, dy, w)[0], rtol=1e-10, atol=1e-12)


# --- finding 19.3: the reserve is an operand like the others --------------------------------


def test_a_reserve_on_another_kind_or_device_is_refused_naming_it():
    x, dy, w, b = problem()
    _, mean, invstd = cudnn_bn.batch_norm_forward_training(x, w, b, None, None)
    with pytest.raises(InfiniError, match="reserve") as caught:
        cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, mode="saved", saved_mean=mean, saved_invstd=invstd,
            reserve=[1, 2, 3],
        )  # fmt: skip
    assert caught.value.status == Status.BAD_PARAM
    with pytest.raises(InfiniError, match=r"reserve on NVIDIA|arrays must share one device"):
        cudnn_bn.batch_norm_backward(
            x, dy, w, None, None, mode="saved", saved_mean=mean, saved_invstd=invstd,
            reserve=_CudaBuffer(),
        )  # fmt: skip


def test_a_cuda_interface_input_among_host_arrays_is_refused_before_cuda(monkeypatch):
    """The input's place alone was once found first: a CUDA array interface's pointer sent
    CUDA a query (DEVICE_NOT_INITIALIZED here) before the host arrays beside it were seen
    (found by the array fuzzer)."""
    from cudnn_bn.backends import cuda

    asked = []
    monkeypatch.setattr(cuda, "cupy_module", lambda: asked.append(1) or pytest.fail("CUDA asked"))
    x, dy, w, _ = problem()
    device = CudaInterface(
        {"version": 3, "shape": x.shape, "typestr": "<f8", "data": (x.ctypes.data, 0)}
    )
    with pytest.raises(InfiniError, match="share one device") as caught:
        cudnn_bn.batch_norm_backward(device, dy, w, None, None)
    assert caught.value.status == Status.BAD_PARAM and not asked


def test_cupyx_compat_refuses_a_cuda_interface_among_host_arrays_before_cuda(monkeypatch):
    """``cupyx_compat`` described its arrays one by one, so a CUDA array interface asked
    CUDA where its pointer lives before the host arrays beside it were seen (found by the
    array fuzzer)."""
    from cudnn_bn import cupyx_compat
    from cudnn_bn.backends import cuda

    asked = []
    monkeypatch.setattr(cuda, "cupy_module", lambda: asked.append(1) or pytest.fail("CUDA asked"))
    x, _, w, b = problem()
    device = CudaInterface(
        {"version": 3, "shape": (C,), "typestr": "<f8", "data": (w.ctypes.data, 0)}
    )
    # CuPy 13 took CuPy arrays only: an object with no astype is refused first, as TypeError
    with pytest.raises(TypeError, match="mean must be a NumPy or CuPy array") as caught:
        cupyx_compat.batch_normalization_forward_inference(
            x, w, b, device, np.ones(C), 1e-5, True, cupyx_compat.CUDNN_BATCHNORM_SPATIAL
        )
    assert caught.value.status == Status.BAD_PARAM and not asked


def test_cupyx_compat_writes_a_strided_running_var_after_a_packed_running_mean():
    """The running statistics were written back one by one, each first described as "one
    packed buffer": a strided running_var was refused (BAD_TENSOR_STRIDES) after
    running_mean had been updated (found by the array fuzzer)."""
    from cudnn_bn import cupyx_compat

    x, _, w, b = problem()
    running_mean, wide = np.zeros(C), np.ones(2 * C)
    running_var = wide[::2]
    cupyx_compat.batch_normalization_forward_training(
        x, w, b, running_mean, running_var, None, None, 1e-5, 0.9, True,
        cupyx_compat.CUDNN_BATCHNORM_SPATIAL, False,
    )  # fmt: skip
    xt = torch.tensor(x)
    want_mean, want_var = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    torch.nn.functional.batch_norm(xt, want_mean, want_var, training=True, momentum=0.1)
    np.testing.assert_allclose(running_mean, want_mean.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(running_var, want_var.numpy(), rtol=1e-10, atol=1e-12)
    assert (wide[1::2] == 1).all()


class _CudaBuffer:
    """A device buffer (DLPack CUDA device), which a host call must not take."""

    def __dlpack_device__(self):
        return 2, 0

    def __dlpack__(self, **kwargs):
        raise AssertionError("a buffer on another device must not be exported")


def test_a_cuda_error_is_an_infini_error_where_every_array_claims_cuda():
    """Every operand on a CUDA device of a machine without one: CuPy's runtime error, raised
    from a compiled (Cython) frame, is this package's to translate, not the caller's."""

    class OnDevice:
        def __dlpack_device__(self):
            return 2, 0

        def __dlpack__(self, **kwargs):
            raise AssertionError("nothing is exported before the stream is known")

    with pytest.raises(InfiniError) as caught:
        cudnn_bn.batch_norm_forward_inference(OnDevice(), None, None, None, None)
    assert caught.value.status in (Status.DEVICE_NOT_INITIALIZED, Status.DEVICE_NOT_FOUND)


@pytest.mark.parametrize("producer", ["numpy", "torch"])
def test_a_subclass_whose_attributes_lie_is_read_as_its_memory_is(producer):
    """An ndarray or tensor subclass whose ``shape``/``strides`` claim 1000 times its memory
    is read as its memory is: the door took the claimed layout and read (and, written in
    place, would write) past the buffer; the outputs had the claimed shape (an outsider's
    attack, session 12)."""
    rng = np.random.default_rng(19)
    x = rng.standard_normal((4, 3, 5))
    w, zero = np.ones(3), np.zeros(3)
    if producer == "numpy":
        lying, args = x.view(LyingArray), (w, zero, zero, w)
    else:
        lying = torch.from_numpy(x).as_subclass(LyingTensor)
        args = tuple(map(torch.from_numpy, (w, zero, zero, w)))
    assert len(lying.shape) == 4
    got = cudnn_bn.batch_norm_forward_inference(lying, *args)
    want = cudnn_bn.batch_norm_forward_inference(x, w, zero, zero, w)
    assert tuple(got.shape) == x.shape
    np.testing.assert_array_equal(np.asarray(got), want)


class DeviceLyingTensor(torch.Tensor):
    """A tensor subclass whose ``device`` property says cpu once, then cuda:1 (``reads``
    counts its reads), and whose ``__torch_function__`` says cuda:1 too."""

    reads = 0

    @property
    def device(self):
        type(self).reads += 1
        return torch.device("cpu" if type(self).reads == 1 else "cuda:1")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.device.__get__:
            return torch.device("cuda:1")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "stand-ins"])
@pytest.mark.parametrize("at", [0, 3])
def test_a_tensor_subclass_whose_device_lies_is_placed_where_its_memory_is(at, affine):
    """A torch subclass's ``device`` (a property, or its ``__torch_function__``) is not
    asked: the call is placed, checked and allocated where torch's own getter says the
    memory is. The door asked the property three times for the place (each answer
    trusted), the input's ``device`` again for every output's allocation, and for the key
    of the stand-ins for an absent weight and bias (which a lie could have shared with
    another device's calls)."""
    rng = np.random.default_rng(23)
    x, w, zero = rng.standard_normal((4, 3, 5)), np.ones(3), np.zeros(3)
    args = [torch.from_numpy(a.copy()) for a in (x, w, zero, zero, w)]
    args[at] = args[at].as_subclass(DeviceLyingTensor)
    if not affine:
        args[1] = args[2] = None
        cudnn_bn.descriptor_cache.clear()
    DeviceLyingTensor.reads = 0
    got = cudnn_bn.batch_norm_forward_training(*args)
    want = cudnn_bn.batch_norm_forward_training(x, w, zero, zero.copy(), w.copy())
    assert DeviceLyingTensor.reads == 0
    for g, v in zip(got, want, strict=True):
        assert isinstance(g, torch.Tensor) and g.device.type == "cpu"
        np.testing.assert_allclose(np.asarray(g), v)


class Deviceless(Versioned):
    """A DLPack producer without ``__dlpack_device__``: its place is its export's."""

    __dlpack_device__ = property(lambda self: (_ for _ in ()).throw(AttributeError("no")))


def test_a_dlpack_producer_without_its_device_method_is_exported_once_per_call():
    """A host producer without ``__dlpack_device__`` is exported once a call, read or
    written (asked ``copy=False``): its place and its operand are that export's. It was
    exported twice (once for its place, once for its operand), so the call was placed by
    one capsule and run on another."""
    x, _, w, b = problem()
    cudnn_bn.descriptor_cache.clear()
    for _ in ("new", "planned"):
        read, written = Deviceless(x.copy()), Deviceless(np.zeros(C))
        cudnn_bn.batch_norm_forward_training(read, w, b, written, None)
        assert [k["copy"] for k in read.kwargs] == [None]
        assert [k["copy"] for k in written.kwargs] == [False]
        np.testing.assert_allclose(written.array, 0.1 * x.mean(axis=(0, 2)))


_CUPY_SUBCLASS = """
import cupy, numpy as np
from cudnn_bn.arrays import operand

class Lying(cupy.ndarray):
    shape = property(lambda self: (1000, 3, 5))
    strides = property(lambda self: (120, 40, 8))
    device = property(lambda self: cupy.cuda.Device(1))

a = np.zeros((4, 3, 5))
memory = cupy.cuda.UnownedMemory(a.ctypes.data, a.nbytes, a, device_id=0)
x = cupy.ndarray(a.shape, a.dtype, cupy.cuda.MemoryPointer(memory, 0), a.strides).view(Lying)
op = operand("input", x)
print(op.desc.shape, op.desc.strides, op.device_id, op.ptr == a.ctypes.data)
"""


def test_a_cupy_subclass_whose_attributes_lie_is_read_as_its_memory_is():
    """A CuPy subclass's ``shape``, ``strides`` and ``device`` properties are not asked (the
    door took them, so a call read and wrote past the allocation): CuPy's own getters are
    (real CuPy, which makes such an array over host memory without a GPU; in a process of
    its own, since importing CuPy changes what the other tests' stand-ins see)."""
    pytest.importorskip("cupy")
    done = subprocess.run(
        [sys.executable, "-c", _CUPY_SUBCLASS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "(4, 3, 5) (15, 5, 1) 0 True"


class CountingStream:
    """A ``stream=`` object (``__cuda_stream__``) counting the reads of each attribute."""

    def __init__(self) -> None:
        self.reads = {}

    def __getattr__(self, name: str):
        self.reads[name] = self.reads.get(name, 0) + 1
        if name == "__cuda_stream__":
            return lambda: (0, 7)
        raise AttributeError(name)


_PRODUCERS = {
    "array interface": lambda a: HostTurning(a.__array_interface__, a.__array_interface__, 1),
    "dlpack": Versioned,
    "dlpack without its device": Deviceless,
}
_READS = {"array interface": lambda p: p.reads, "dlpack": lambda p: len(p.kwargs)}
_ENTRIES = {  # each entry point's operands (x, dy, w, b, mean, var) and the ones to wrap
    "forward_training": (lambda a, **k: cudnn_bn.batch_norm_forward_training(
        a[0], a[2], a[3], a[4], a[5], **k), (0, 2, 3, 4, 5)),
    "forward_inference": (lambda a, **k: cudnn_bn.batch_norm_forward_inference(
        a[0], a[2], a[3], a[4], a[5], **k), (0, 2, 4)),
    "backward": (lambda a, **k: cudnn_bn.batch_norm_backward(
        a[0], a[1], a[2], None, None, **k), (0, 1, 2)),
    "backward_batched": (lambda a, **k: cudnn_bn.batch_norm_backward_batched(
        a[0][None], a[1][None], a[2], None, None, **k), (2,)),
}  # fmt: skip


@pytest.mark.parametrize("planned", [False, True], ids=["new", "planned"])
@pytest.mark.parametrize("producer", list(_PRODUCERS))
@pytest.mark.parametrize("entry", list(_ENTRIES))
def test_every_entry_point_reads_each_protocol_and_stream_once_per_call(entry, producer, planned):
    """Each array-API entry point reads each operand's protocol (an array interface, a
    DLPack export) and each attribute of a ``stream=`` object once per call, wherever the
    producer stands among the operands, on a new problem and on a plan's hit."""
    call, wrapped = _ENTRIES[entry]
    x, dy, w, b = problem()
    for at in wrapped:
        cudnn_bn.descriptor_cache.clear()
        for _ in range(1 + planned):
            a = [x, dy, w, b, np.zeros(C), np.ones(C)]
            a[at] = made = _PRODUCERS[producer](a[at].copy())
            stream = CountingStream()
            call(a, stream=stream)
            reads = _READS.get(producer, _READS["dlpack"])(made)
            assert reads == 1 and set(stream.reads.values()) == {1}, (at, reads, stream.reads)
