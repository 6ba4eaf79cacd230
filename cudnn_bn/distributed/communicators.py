"""One protocol over the distributed engines synchronized batch norm runs on.

A ``Communicator`` all-gathers and all-reduces (sums) a small 1-D float64 host buffer across
the processes of a group and knows its ``rank``, its ``size`` and the ``device`` the arrays
of a pass must be on (None: any); an engine's failure comes out as ``InfiniError``
(INTERNAL_ERROR) carrying the engine's own message. Each adapter moves the
O(C) buffer where its engine wants it: mpi4py takes host memory (CuPy users' statistics are
staged through the host); torch.distributed takes CPU tensors with gloo, CUDA tensors with
NCCL; CuPy's ``NcclCommunicator`` takes device pointers and a stream.

References: mpi4py's buffer methods (``Comm.Allgather``/``Allreduce``), torch.distributed's
``all_gather``/``all_reduce``, CuPy's ``cupy.cuda.nccl.NcclCommunicator``
(``allGather``/``allReduce``, ``rank_id``, ``size``).
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import numpy as np

from ..backends.cuda import stream_scope
from ..enums import Device, Status
from ..errors import InfiniError

# nccl.h's ncclFloat64 and ncclSum (CuPy exports them as cupy.cuda.nccl.NCCL_FLOAT64/NCCL_SUM).
NCCL_FLOAT64, NCCL_SUM = 8, 0


class Communicator(Protocol):
    """What synchronized batch norm needs from a distributed engine."""

    engine: str
    rank: int
    size: int
    device: tuple[Device, int] | None

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (1-D float64, one length on all ranks), as ``(size, n)``."""
        ...

    def allreduce(self, values: np.ndarray) -> np.ndarray:
        """The element-wise sum of every rank's ``values`` (1-D float64)."""
        ...


@contextmanager
def _engine_errors(
    engine: str, what: str, errors: tuple[type[BaseException], ...]
) -> Iterator[None]:
    try:
        yield
    except errors as exc:
        raise InfiniError(Status.INTERNAL_ERROR, f"{engine} {what} failed: {exc}") from exc


class MpiCommunicator:
    """An mpi4py ``Comm``: buffer collectives on host memory, no pickling."""

    engine = "MPI"
    device = None  # host buffers: the arrays may be anywhere

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._comm, self._mpi = comm, MPI
        if comm == MPI.COMM_NULL:  # MPI's own error for it would be an INTERNAL_ERROR
            raise InfiniError(Status.BAD_PARAM, "group is MPI.COMM_NULL (a null or freed comm)")
        with self._errors("Comm.Is_inter"):
            inter = comm.Is_inter()
        if inter:  # its collectives would give each group the other's sums
            raise InfiniError(
                Status.BAD_PARAM,
                "group is an MPI intercommunicator, whose collectives reduce the remote "
                "group's values: give an intracommunicator (Intercomm.Merge() makes one)",
            )
        with self._errors("Comm.Get_rank/Get_size"):
            self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def _errors(self, what: str) -> AbstractContextManager[None]:
        return _engine_errors(self.engine, what, (self._mpi.Exception,))

    def allgather(self, values: np.ndarray) -> np.ndarray:
        gathered = np.empty((self.size, values.size))
        with self._errors("Allgather"):
            self._comm.Allgather(np.ascontiguousarray(values), gathered)
        return gathered

    def allreduce(self, values: np.ndarray) -> np.ndarray:
        reduced = np.empty(values.size)
        with self._errors("Allreduce"):
            self._comm.Allreduce(np.ascontiguousarray(values), reduced, op=self._mpi.SUM)
        return reduced


class TorchCommunicator:
    """A torch.distributed process group: CPU tensors for gloo (and other CPU backends),
    tensors on the current CUDA device for NCCL."""

    engine = "torch.distributed"

    def __init__(self, group: Any) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self._group = torch, dist, group
        if not dist.is_initialized():  # torch's own error for it would be an INTERNAL_ERROR
            raise InfiniError(
                Status.BAD_PARAM,
                "group is a torch.distributed process group, but torch.distributed is not "
                "initialized (destroy_process_group was called, or init_process_group not yet)",
            )
        with self._errors("get_rank/get_world_size"):
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
            on_gpu = dist.get_backend(group) == "nccl"
        index = torch.cuda.current_device() if on_gpu else None
        self._device = "cpu" if index is None else torch.device("cuda", index)
        # NCCL reads buffers on this device; gloo's are host copies.
        self.device = None if index is None else (Device.NVIDIA, index)

    def _errors(self, what: str) -> AbstractContextManager[None]:
        return _engine_errors(self.engine, what, (RuntimeError, ValueError))

    def allgather(self, values: np.ndarray) -> np.ndarray:
        mine = self._torch.from_numpy(np.ascontiguousarray(values)).to(self._device)
        parts = [self._torch.empty_like(mine) for _ in range(self.size)]
        with self._errors("all_gather"):
            self._dist.all_gather(parts, mine, group=self._group)
        return self._torch.stack(parts).cpu().numpy()

    def allreduce(self, values: np.ndarray) -> np.ndarray:
        buffer = self._torch.tensor(values, dtype=self._torch.float64, device=self._device)
        with self._errors("all_reduce"):
            self._dist.all_reduce(buffer, op=self._dist.ReduceOp.SUM, group=self._group)
        return buffer.cpu().numpy()


class NcclCommunicator:
    """CuPy's ``cupy.cuda.nccl.NcclCommunicator``: the buffer staged into the memory of the
    communicator's device, made current, and the collective queued on ``stream`` (a
    ``cudaStream_t`` address on that device), then read back."""

    engine = "NCCL"

    def __init__(self, comm: Any, stream: Callable[[], int]) -> None:
        import cupy

        self._comm, self._stream, self._cupy = comm, stream, cupy
        self._errors_caught = _nccl_errors()
        with self._errors("rank_id/size/device_id"):
            self.rank, self.size = comm.rank_id(), comm.size()
            self.device = (Device.NVIDIA, comm.device_id())

    def _errors(self, what: str) -> AbstractContextManager[None]:
        return _engine_errors(self.engine, what, self._errors_caught)

    def _run(self, what: str, values: np.ndarray, out_shape: tuple[int, ...], call: Any) -> Any:
        """Copy in, collective, copy out: all three queued on the pass's stream, in order."""
        stream = self._stream()
        with stream_scope(stream, self.device[1]):
            send = self._cupy.asarray(np.ascontiguousarray(values))
            recv = self._cupy.empty(out_shape, np.float64)
            with self._errors(what):
                call(send.data.ptr, recv.data.ptr, values.size, stream)
            return self._cupy.asnumpy(recv)  # waits for the stream

    def allgather(self, values: np.ndarray) -> np.ndarray:
        def call(send: int, recv: int, count: int, stream: int) -> None:
            self._comm.allGather(send, recv, count, NCCL_FLOAT64, stream)

        return self._run("allGather", values, (self.size, values.size), call)

    def allreduce(self, values: np.ndarray) -> np.ndarray:
        def call(send: int, recv: int, count: int, stream: int) -> None:
            self._comm.allReduce(send, recv, count, NCCL_FLOAT64, NCCL_SUM, stream)

        return self._run("allReduce", values, (values.size,), call)


def _nccl_errors() -> tuple[type[BaseException], ...]:
    """CuPy's ``NcclError`` where CuPy's NCCL module loads, and RuntimeError."""
    try:
        from cupy.cuda.nccl import NcclError
    except ImportError:
        return (RuntimeError,)
    return (NcclError, RuntimeError)


def communicator(group: Any, stream: Callable[[], int]) -> Communicator:
    """The adapter for ``group``; ``stream`` gives the pass's stream (NCCL queues there; 0,
    the legacy default stream, where the pass's arguments were refused)."""
    if all(hasattr(group, n) for n in ("allGather", "allReduce", "rank_id")):
        return NcclCommunicator(group, stream)
    if all(hasattr(group, n) for n in ("Allgather", "Allreduce", "Get_rank")):
        return MpiCommunicator(group)
    if type(group).__module__.startswith("torch"):
        import torch.distributed as dist

        if isinstance(group, dist.ProcessGroup):
            return TorchCommunicator(group)
    raise InfiniError(
        Status.BAD_PARAM,
        "group must be an mpi4py communicator, a torch.distributed process group or a "
        f"cupy.cuda.nccl.NcclCommunicator, got {type(group).__name__}",
    )
