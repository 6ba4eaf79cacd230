"""One rank of a synchronized-batch-norm group, spawned by ``tests/test_distributed.py``.

``python distributed_worker.py ENGINE OUT`` runs every case in ``CASES`` on this rank and
writes ``OUT/rank-<r>.json`` after each one: case -> "" (passed) or the failure's traceback,
and ``"numbers"`` -> what the cases measured. Each case checks this rank's results against
references over the concatenated global batch (every rank builds the same global batch from
one seed and takes its slice): PyTorch float64 on the values rounded to the case's dtype,
and single-process ``cudnn_bn``. ENGINE is ``mpi`` (run under ``mpiexec``; NumPy arrays),
``gloo`` (torch.distributed over 127.0.0.1, torch CPU tensors; RANK, WORLD_SIZE and
MASTER_PORT in the environment), or, on GPUs and under ``mpiexec``, ``mpi-cupy`` (CuPy
arrays, MPI through the host), ``nccl-torch`` (torch CUDA tensors) and ``nccl-cupy`` (CuPy
arrays on CuPy's NCCL communicator).
"""

import json
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from helpers import EPS, TOL, random_values, reference, torch_training

import cudnn_bn
from cudnn_bn import InfiniError, Status
from cudnn_bn.distributed import (
    sync_batch_norm_backward,
    sync_batch_norm_forward_training,
)
from cudnn_bn.nn import SyncBatchNorm

MOMENTUM = 0.1
KINDS = {  # engine -> the arrays it runs on
    "mpi": "numpy",
    "gloo": "torch",
    "mpi-cupy": "cupy",
    "nccl-cupy": "cupy",
    "nccl-torch": "torch",
}
TOLERANCE = {"f64": 1e-12, "f32": TOL[torch.float32], "f16": 1e-2, "bf16": 1e-2}
TAILS = {2: (3,), 3: (3, 5), 4: (3, 4, 5), 5: (3, 2, 3, 4)}  # shape but N, per rank of tensor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank:
    """This process's group, its array kind, and conversions between that kind and float64."""

    def __init__(self, engine: str) -> None:
        self.engine, self.kind = engine, KINDS[engine]
        if engine == "gloo":
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
            )
            self.group, self.rank, self.size = (
                dist.group.WORLD,
                dist.get_rank(),
                dist.get_world_size(),
            )
            return
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        self.rank, self.size, self.group = world.rank, world.size, world
        if engine == "nccl-torch":
            import torch.distributed as dist

            torch.cuda.set_device(self.rank % torch.cuda.device_count())
            port = world.bcast(_free_port() if self.rank == 0 else None)
            dist.init_process_group(
                "nccl",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=self.rank,
                world_size=self.size,
            )
            self.group = dist.group.WORLD
        elif self.kind == "cupy":
            import cupy

            cupy.cuda.Device(self.rank % cupy.cuda.runtime.getDeviceCount()).use()
        if engine == "nccl-cupy":
            from cupy.cuda import nccl

            uid = world.bcast(nccl.get_unique_id() if self.rank == 0 else None)
            self.group = nccl.NcclCommunicator(self.size, uid, self.rank)

    def dtype(self, name: str) -> Any:
        if self.kind == "numpy":
            import ml_dtypes

            return {"f64": np.float64, "f32": np.float32, "f16": np.float16}.get(
                name, ml_dtypes.bfloat16
            )
        if self.kind == "cupy":
            return {"f64": np.float64, "f32": np.float32, "f16": np.float16}[name]
        return {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16}.get(
            name, torch.bfloat16
        )

    def array(self, values: np.ndarray, dtype: str) -> Any:
        """``values`` as this engine's array of ``dtype`` (on this rank's GPU for NCCL)."""
        if self.kind == "numpy":
            return np.asarray(values).astype(self.dtype(dtype))
        if self.kind == "cupy":
            import cupy

            return cupy.asarray(values).astype(self.dtype(dtype))
        tensor = torch.tensor(values).to(self.dtype(dtype))  # a copy: no two arrays alias
        return tensor.cuda() if self.engine == "nccl-torch" else tensor

    def host(self, array: Any) -> np.ndarray:
        if isinstance(array, torch.Tensor):
            return array.detach().to("cpu", torch.float64, copy=True).numpy()
        if self.kind == "cupy":
            import cupy

            return cupy.asnumpy(array).astype(np.float64)
        return np.asarray(array, dtype=np.float64)

    def channels_last(self, array: Any) -> Any:
        """The same values with the channel axis innermost in memory."""
        if isinstance(array, torch.Tensor):
            return array.movedim(1, -1).contiguous().movedim(-1, 1)
        xp = np if self.kind == "numpy" else __import__("cupy")
        return xp.moveaxis(xp.ascontiguousarray(xp.moveaxis(array, 1, -1)), -1, 1)


def close(what: str, actual: np.ndarray, expected: np.ndarray, tol: float) -> float:
    """The largest error of ``actual`` against ``expected``; fails past ``tol`` (abs + rel)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (
        f"{what}: shape {actual.shape}, expected {expected.shape}"
    )
    error = np.abs(actual - expected)
    worst = float(error.max(initial=0.0))
    assert np.all(error <= tol + tol * np.abs(expected)), f"{what}: max error {worst} > {tol}"
    return worst


def split(size: int, empty: bool) -> list[int]:
    """Uneven batch sizes per rank; with ``empty``, rank 1 has none."""
    counts = [2 + 3 * r + r % 2 for r in range(size)]
    if empty:
        counts[1] = 0
    return counts


def check_passes(
    me: Rank,
    tail: tuple[int, ...],
    counts: list[int],
    data: str,
    channel: str,
    *,
    seed: int = 0,
    layout: Callable[[Any], Any] | None = None,
    mask: tuple[bool, bool, bool] = (True, True, True),
    against_cudnn_bn: bool = False,
) -> float:
    """Forward and backward on this rank's slice against the global batch; the largest error."""
    v = random_values((sum(counts), *tail), seed, bias=True)
    full = {n: me.array(a, data if a.ndim > 1 else channel) for n, a in v.items()}
    rounded = {n: me.host(a) for n, a in full.items()}
    lo = sum(counts[: me.rank])
    hi = lo + counts[me.rank]
    x, dy = full["input"][lo:hi], full["grad_output"][lo:hi]
    if layout is not None:
        x, dy = layout(x), layout(dy)
    w, b = full["weight"], full["bias"]
    rm, rv = me.array(v["running_mean"], channel), me.array(v["running_var"], channel)
    y, mean, invstd = sync_batch_norm_forward_training(
        x, w, b, rm, rv, group=me.group, momentum=MOMENTUM, eps=EPS
    )
    ref_y, ref_mean, ref_invstd, ref_rm, ref_rv = torch_training(rounded, MOMENTUM)
    tol = TOLERANCE[data]
    errors = [
        close("output", me.host(y), ref_y.numpy()[lo:hi], tol),
        close("saved_mean", me.host(mean), ref_mean.numpy(), tol),
        close("saved_invstd", me.host(invstd), ref_invstd.numpy(), tol),
        close("running_mean", me.host(rm), ref_rm.numpy(), tol),
        close("running_var", me.host(rv), ref_rv.numpy(), tol),
    ]
    grads = sync_batch_norm_backward(x, dy, w, mean, invstd, group=me.group, output_mask=mask)
    saved = dict(mode="saved", mean=me.host(mean), invstd=me.host(invstd))
    global_grad_input = reference(
        rounded["input"], rounded["grad_output"], rounded["weight"], **saved
    )[0]
    if hi > lo:  # torch's kernel cannot take an empty batch
        local = reference(
            rounded["input"][lo:hi], rounded["grad_output"][lo:hi], rounded["weight"], **saved
        )
        local_sums = [g.numpy() for g in local[1:]]
    else:
        local_sums = [np.zeros(tail[0]), np.zeros(tail[0])]
    expected = (global_grad_input.numpy()[lo:hi], *local_sums)
    for name, wanted, got, want in zip(
        ("grad_input", "grad_weight", "grad_bias"), mask, grads, expected, strict=True
    ):
        if not wanted:
            assert got is None, f"{name} was not asked for but came back"
            continue
        errors.append(close(name, me.host(got), want, tol))
    if against_cudnn_bn:  # single-process cudnn_bn on the same global batch, same kind
        rm1, rv1 = me.array(v["running_mean"], channel), me.array(v["running_var"], channel)
        one = cudnn_bn.batch_norm_forward_training(
            full["input"], w, b, rm1, rv1, momentum=MOMENTUM, eps=EPS
        )
        for name, got, want in zip(
            ("output", "saved_mean", "saved_invstd"), (y, mean, invstd), one, strict=True
        ):
            want = me.host(want)
            errors.append(
                close(
                    f"{name} (cudnn_bn)",
                    me.host(got),
                    want[lo:hi] if name == "output" else want,
                    tol,
                )
            )
        errors += [close("running stats (cudnn_bn)", me.host(rm), me.host(rm1), tol)]
        one_grad = cudnn_bn.batch_norm_backward(
            full["input"], full["grad_output"], w, None, None,
            mode="saved", saved_mean=one[1], saved_invstd=one[2],
        )[0]  # fmt: skip
        errors.append(
            close("grad_input (cudnn_bn)", me.host(grads[0]), me.host(one_grad)[lo:hi], tol)
        )
    return max(errors)


# --- cases: each passes silently or raises --------------------------------------------------

numbers: dict[str, Any] = {}


def case_layouts_f64(me: Rank) -> None:
    """Ranks 2-5 tensors, uneven splits, with and without an empty rank, within 1e-12."""
    worst = 0.0
    for ndim, tail in TAILS.items():
        for empty in (False, True):
            worst = max(
                worst,
                check_passes(
                    me, tail, split(me.size, empty), "f64", "f64", seed=ndim, against_cudnn_bn=True
                ),
            )
    numbers["f64 max error"] = worst


def case_dtypes(me: Rank) -> None:
    """F32, F16 (F16 weight: the sums widen to F32) and BF16 (F32 weight), within the suite's
    tolerances."""
    pairs = [("f32", "f32"), ("f16", "f16"), ("f16", "f32")]
    if me.kind != "cupy":  # CuPy has no bfloat16
        pairs += [("bf16", "f32"), ("bf16", "bf16")]
    for data, channel in pairs:
        worst = check_passes(me, (4, 6), split(me.size, True), data, channel, seed=7)
        numbers[f"{data} data, {channel} weight: max error"] = worst


def case_channels_last(me: Rank) -> None:
    check_passes(me, (3, 4, 5), split(me.size, False), "f32", "f32", layout=me.channels_last)


def case_output_mask(me: Rank) -> None:
    for mask in ((True, False, False), (False, True, True), (True, True, False)):
        check_passes(me, (3, 5), split(me.size, True), "f64", "f64", mask=mask)


def case_large_offset(me: Rank) -> None:
    """Data around 1e8 with unit spread: combined from sums of squares, the variance would be
    lost to cancellation; the (count, mean, M2) combination keeps it."""
    counts = split(me.size, False)
    rng = np.random.default_rng(3)
    x_all = 1e8 + rng.standard_normal((sum(counts), 2, 16))
    lo = sum(counts[: me.rank])
    x = me.array(x_all[lo : lo + counts[me.rank]], "f64")
    ones, zeros = me.array(np.ones(2), "f64"), me.array(np.zeros(2), "f64")
    _, mean, invstd = sync_batch_norm_forward_training(x, ones, zeros, None, None, group=me.group)
    var = x_all.var(axis=(0, 2))
    close("saved_invstd", me.host(invstd), 1 / np.sqrt(var + EPS), 1e-9)
    close("saved_mean", me.host(mean), x_all.mean(axis=(0, 2)), 1e-15)


def _expect(me: Rank, status: Status, call: Callable[[], Any], own: Status | None = None) -> str:
    """``call()`` raises ``InfiniError`` with ``status`` (``own`` on the rank at fault)."""
    try:
        call()
    except InfiniError as exc:
        assert exc.status == (own or status), f"rank {me.rank}: {exc!r}, expected {status.name}"
        return str(exc)
    raise AssertionError(f"rank {me.rank}: no error, expected {status.name}")


def _problem(me: Rank, channels: int = 3, dtype: str = "f64", n: int = 4) -> dict[str, Any]:
    v = random_values((n, channels, 5), seed=11, bias=True)
    return {k: me.array(a, dtype) for k, a in v.items()}


def case_mismatches_raise_everywhere(me: Rank) -> None:
    """Ranks that disagree, or one rank's bad argument, raise on every rank; nothing written."""
    last = me.rank == me.size - 1

    def attempt(status: Status, p: dict[str, Any], **changes: Any) -> str:
        args = {**p, **changes}
        before = [me.host(args[n]).copy() for n in ("running_mean", "running_var")]
        message = _expect(
            me,
            status,
            lambda: sync_batch_norm_forward_training(
                *(args[n] for n in ("input", "weight", "bias", "running_mean", "running_var")),
                group=me.group,
                eps=args.get("eps", EPS),
            ),
        )
        after = [me.host(args[n]) for n in ("running_mean", "running_var")]
        assert all(map(np.array_equal, before, after)), "running statistics written"
        return message

    message = attempt(Status.BAD_TENSOR_SHAPE, _problem(me, channels=4 if last else 3))
    assert "disagree" in message, message
    attempt(Status.BAD_TENSOR_DTYPE, _problem(me, dtype="f32" if last else "f64"))
    p = _problem(me)
    bad_weight = me.array(np.ones(5), "f64") if last else p["weight"]
    message = attempt(Status.BAD_TENSOR_SHAPE, p, weight=bad_weight)
    assert ("weight" in message) if last else (f"rank {me.size - 1}" in message), message
    attempt(Status.BAD_PARAM, p, eps=1e-3 if me.rank == 0 else EPS)
    attempt(Status.NULL_POINTER, p, input=None if last else p["input"])
    # Rank 0 with one value per channel, where no statistics of its own are computed: its
    # arguments are still checked before the first collective (issue 16 #8).
    few = _problem(me, n=1 if me.rank == 0 else 4)
    few["input"] = few["input"][:, :, :1]
    own = few["input"][0, :, 0] if me.rank == 0 else few["running_mean"]
    message = attempt(Status.BAD_PARAM, few, running_mean=own)  # a view of the input
    assert "share memory" in message if me.rank == 0 else "failed on rank 0" in message, message
    if me.kind == "numpy":
        reversed_channels = few["input"][:, ::-1] if me.rank == 0 else few["input"]
        attempt(Status.BAD_TENSOR_STRIDES, few, input=reversed_channels)
    one = _problem(me, n=1 if me.rank == 0 else 0)  # one value per channel in all
    attempt(Status.BAD_TENSOR_SHAPE, one, input=one["input"][:, :, :1])

    def forward() -> Any:
        names = ("input", "weight", "bias", "running_mean", "running_var")
        return sync_batch_norm_forward_training(*(p[n] for n in names), group=me.group)

    _, mean, invstd = forward()  # the group is still in step after every failure
    x, dy, w = p["input"], p["grad_output"], p["weight"]

    def backward(**changes: Any) -> Any:
        args = dict(input=x, grad_output=dy, weight=w, saved_mean=mean, saved_invstd=invstd)
        mask = changes.pop("output_mask", (True, True, True))
        args.update(changes)
        return sync_batch_norm_backward(**args, group=me.group, output_mask=mask)

    bad_stats = me.array(np.ones(3), "f32") if last else invstd
    _expect(me, Status.BAD_TENSOR_DTYPE, lambda: backward(saved_invstd=bad_stats))
    mask = (False, True, True) if last else (True, True, True)
    _expect(me, Status.BAD_PARAM, lambda: backward(output_mask=mask))
    # grad_output of another kind than input on one rank (issue 16 #8, #10)
    host_dy = me.host(dy)
    other = torch.from_numpy(host_dy) if me.kind != "torch" else host_dy
    _expect(me, Status.BAD_PARAM, lambda: backward(grad_output=other if last else dy))
    backward()


def case_bytes_per_pass(me: Rank) -> None:
    """What each rank sends per pass, counted at the communicator, for C = 64."""
    from cudnn_bn.distributed import sync_batch_norm as module

    sent: list[int] = []
    original = module.communicator

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner, self.rank, self.size = inner, inner.rank, inner.size
            self.device = inner.device

        def allgather(self, values: np.ndarray) -> np.ndarray:
            sent.append(values.nbytes)
            return self.inner.allgather(values)

        def allreduce(self, values: np.ndarray) -> np.ndarray:
            sent.append(values.nbytes)
            return self.inner.allreduce(values)

    module.communicator = lambda group, stream: Counting(original(group, stream))
    try:
        p = _problem(me, channels=64)
        _, mean, invstd = sync_batch_norm_forward_training(
            p["input"], p["weight"], p["bias"], p["running_mean"], p["running_var"], group=me.group
        )
        forward = sum(sent)
        sync_batch_norm_backward(
            p["input"], p["grad_output"], p["weight"], mean, invstd, group=me.group
        )
        backward = sum(sent) - forward
    finally:
        module.communicator = original
    numbers["bytes sent per rank, forward, C=64"] = forward
    numbers["bytes sent per rank, backward, C=64"] = backward
    assert forward == backward == 8 * (10 + 2 * 64), sent


def _check_layer(me: Rank, fusion: str | None, momentum: float | None, affine: bool) -> None:
    """``cudnn_bn.nn.SyncBatchNorm`` on this rank's slice (uneven, rank 1 empty) against
    torch's ``BatchNorm1d`` on the global batch, float64, over training and eval steps: the
    output, grad_input and grad_z slices, this rank's share of the parameter gradients
    (torch's with grad_output zero outside the slice), the running statistics and
    num_batches_tracked after every step. Every step runs on every rank, failed or not, so
    that the ranks stay in step; the failures are reported at the end."""
    counts = split(me.size, True)
    lo = sum(counts[: me.rank])
    hi = lo + counts[me.rank]
    tail = (3, 4)
    module = torch.nn.BatchNorm1d(3, eps=EPS, momentum=momentum, affine=affine).double()
    layer = SyncBatchNorm(3, EPS, momentum, affine, fusion=fusion, group=me.group)
    rng = np.random.default_rng(21)
    if affine:
        with torch.no_grad():
            module.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
            module.bias.normal_(generator=torch.Generator().manual_seed(2))
    layer.load_state_dict({n: v.numpy() for n, v in module.state_dict().items()})
    params = [module.weight, module.bias] if affine else []
    totals = [torch.zeros(3, dtype=torch.float64) for _ in params]
    failures = []
    for step, training in enumerate((True, True, True, False, True)):
        try:  # a failing step must not skip the collectives the other ranks wait in
            module.train(training)
            layer.train(training)
            x, dy, z = (rng.standard_normal((sum(counts), *tail)) * 2 + 1 for _ in range(3))
            xt, zt = torch.tensor(x, requires_grad=True), torch.tensor(z, requires_grad=True)
            y = module(xt)
            if fusion is not None:
                y = torch.relu(y + zt if fusion == "add_relu" else y)
            grad_x, grad_z = torch.autograd.grad(
                y, [xt, zt], torch.tensor(dy), retain_graph=True, allow_unused=True
            )
            local_dy = torch.zeros_like(y)
            local_dy[lo:hi] = torch.tensor(dy[lo:hi])
            if params:
                for total, grad in zip(
                    totals, torch.autograd.grad(y, params, local_dy), strict=True
                ):
                    total += grad
            mine = {n: me.array(v[lo:hi], "f64") for n, v in dict(x=x, dy=dy, z=z).items()}
            output = layer(mine["x"], mine["z"] if fusion == "add_relu" else None)
            grads = layer.backward(mine["dy"])
            if fusion == "add_relu":
                grads, got_z = grads
                close(f"step {step}: grad_z", me.host(got_z), grad_z[lo:hi].numpy(), 1e-12)
            close(f"step {step}: output", me.host(output), y.detach()[lo:hi].numpy(), 1e-12)
            close(f"step {step}: grad_input", me.host(grads), grad_x[lo:hi].numpy(), 1e-12)
            for name, total in zip(("weight_grad", "bias_grad"), totals, strict=False):
                close(f"step {step}: {name}", me.host(getattr(layer, name)), total.numpy(), 1e-12)
            for name in ("running_mean", "running_var"):
                close(
                    f"step {step}: {name}",
                    me.host(getattr(layer, name)),
                    getattr(module, name).numpy(),
                    1e-12,
                )
            assert layer.num_batches_tracked == int(module.num_batches_tracked), step
        except Exception:
            failures.append(traceback.format_exc())
    assert not failures, "\n".join(failures)


def case_layer(me: Rank) -> None:
    _check_layer(me, None, 0.1, True)


def case_layer_fused_cumulative(me: Rank) -> None:
    _check_layer(me, "add_relu", None, True)


def case_layer_without_affine(me: Rank) -> None:
    _check_layer(me, "relu", 0.1, False)


def case_an_intercommunicator_is_refused(me: Rank) -> None:
    """An MPI intercommunicator (two halves of the ranks) as group is BAD_PARAM naming the
    group on every rank, nothing written: its Allreduce would give each half the other's
    sums (with the refusal removed, each half normalizes by the other half's statistics)."""
    if not me.engine.startswith("mpi"):
        return
    from mpi4py import MPI

    color = me.rank % 2  # world ranks 0 and 1 lead the halves
    half = MPI.COMM_WORLD.Split(color, me.rank)
    inter = half.Create_intercomm(0, MPI.COMM_WORLD, 1 - color, tag=17)
    try:
        p = _problem(me)
        names = ("input", "weight", "bias", "running_mean", "running_var")
        before = [me.host(p[n]).copy() for n in ("running_mean", "running_var")]
        message = _expect(
            me,
            Status.BAD_PARAM,
            lambda: sync_batch_norm_forward_training(*(p[n] for n in names), group=inter),
        )
        assert "group" in message and "intercommunicator" in message, message
        after = [me.host(p[n]) for n in ("running_mean", "running_var")]
        assert all(map(np.array_equal, before, after)), "running statistics written"
    finally:
        inter.Free()
        half.Free()


class _FailingComm:
    """An mpi4py communicator whose collectives fail as MPI reports a failure: the engine's
    own error, raised where the communicator's Allgather runs."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def Allgather(self, *args: Any) -> None:  # mpi4py's name
        from mpi4py import MPI

        raise MPI.Exception(MPI.ERR_OTHER)


def case_engine_error(me: Rank) -> None:
    """An engine's own failure surfaces as InfiniError with the engine's message."""
    p = _problem(me)
    args = (p["input"], p["weight"], p["bias"], None, None)
    if me.engine.startswith("mpi"):
        message = _expect(
            me,
            Status.INTERNAL_ERROR,
            lambda: sync_batch_norm_forward_training(*args, group=_FailingComm(me.group)),
        )
        assert message.startswith("INTERNAL_ERROR: MPI Allgather failed"), message
    elif me.engine == "gloo" and me.rank == 0:  # the last case: the other ranks have left
        message = _expect(
            me,
            Status.INTERNAL_ERROR,
            lambda: sync_batch_norm_forward_training(*args, group=me.group),
        )
        assert "torch.distributed all_gather failed" in message, message


CASES = {
    name.removeprefix("case_"): fn
    for name, fn in list(globals().items())
    if name.startswith("case_")
}


def main() -> None:
    engine, out = sys.argv[1], Path(sys.argv[2])
    me = Rank(engine)
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        if engine == "gloo" and name == "engine_error" and me.rank != 0:
            results[name] = ""  # leaving is this rank's part: rank 0's peers are gone
            break
        try:
            case(me)
            results[name] = ""
        except Exception:
            results[name] = traceback.format_exc()
        results["numbers"] = numbers
        (out / f"rank-{me.rank}.json").write_text(json.dumps(results))
    (out / f"rank-{me.rank}.json").write_text(json.dumps(results))
    if engine == "gloo" and me.rank != 0:
        os._exit(0)  # leave without the process group's goodbye, as a crashed peer would


if __name__ == "__main__":
    main()
