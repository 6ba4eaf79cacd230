"""Fuzz target: the synchronized passes (``test_fuzz_distributed.py`` runs it).

Every case is drawn from one seed: a global batch split unevenly over the ranks (a rank may
have N = 0 or one value per channel), NumPy or torch arrays of F32/F64 (torch running
statistics sometimes made under ``torch.inference_mode()``), forward or backward,
weight/bias sometimes None, and, on one rank only (drawn too), one fault: an argument in a
form of ``fuzz_arrays.FORMS`` (a list, None, an integer or F16 array, a read-only,
reversed or broadcast view...), an argument of another kind, a running statistic that
aliases another argument or views the input, too many channels, a bad eps, momentum or
output_mask.

Two modes. Alone, ``python fuzz_distributed.py SECONDS`` is a group of one (mpi4py's
``COMM_SELF``, now and then ``COMM_NULL``, which must be refused) and hypothesis draws the
seeds. Under ``mpiexec -n R``, ``... SECONDS`` runs in lockstep: rank 0 draws each seed and
says when time is up, every rank builds the same case, and the faulty rank's arguments
differ; the group is, by the seed, MPI's world or a torch.distributed gloo group over
127.0.0.1 (MPI keeps the ranks in step).

Invariants: every rank returns, or every rank raises an ``InfiniError`` of one status that
is not INTERNAL_ERROR; when any rank fails, no rank changed any argument; results equal
PyTorch's float64 on the global batch (the forward's output, saved and running statistics;
the backward's ``grad_input`` and this rank's ``grad_weight``/``grad_bias``). Rank 0
prints the counts, summed over the ranks, as ``fuzz_arrays.py`` does.
"""

import sys
import time
import warnings

import numpy as np
import torch
from fuzz_arrays import FORMS, _torch_training, arrange, f64, snapshot
from fuzzing import COUNTS, SETTINGS, child_main, problem_values, violation
from helpers import TOL, reference
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

from cudnn_bn import InfiniError, Status
from cudnn_bn.distributed import sync_batch_norm_backward, sync_batch_norm_forward_training

FAULTS = ["none", "none", "form", "kind", "alias", "channels", "scalar"]
FORWARD = ("input", "weight", "bias", "running_mean", "running_var")
BACKWARD = ("input", "grad_output", "weight", "saved_mean", "saved_invstd")
BAD_SCALARS = {
    "eps": [-1.0, float("nan"), "0.1", None],
    "momentum": [1.5, float("inf"), "0.1", None],
    "output_mask": [(True, True), "all", None],
}


def draw_case(seed: int, ranks: int, rank: int) -> dict:
    """The case of ``seed``: every rank draws the same, then takes its share."""
    rng = np.random.default_rng(seed)
    ndim, c = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    tail = tuple(int(n) for n in rng.integers(1, 4, ndim - 2))
    sizes = [int(rng.choice([0, 1, 2, 3, 5])) for _ in range(ranks)]
    values = problem_values(rng, (sum(sizes), c, *tail))
    dtype = rng.choice([np.float32, np.float64])
    kind = str(rng.choice(["numpy", "torch"]))
    entry = str(rng.choice(["forward", "backward"]))
    absent = [n for n in ("weight", "bias") if rng.integers(0, 5) == 0]
    scalars = {"eps": float(rng.choice([1e-5, 1e-3, 0.0])), "momentum": 0.1}
    scalars["output_mask"] = tuple(bool(b) for b in rng.integers(0, 2, 3))
    fault, bad_rank = str(rng.choice(FAULTS)), int(rng.integers(0, ranks))
    names = FORWARD if entry == "forward" else BACKWARD
    target = str(rng.choice(names))
    form = str(rng.choice(FORMS))
    alias = str(rng.choice(["running_var", "weight", "bias", "input"]))
    bad_scalar = str(rng.choice(list(BAD_SCALARS)))
    bad_value = BAD_SCALARS[bad_scalar][int(rng.integers(0, len(BAD_SCALARS[bad_scalar])))]
    inference = kind == "torch" and rng.integers(0, 4) == 0  # statistics of inference_mode

    lo = sum(sizes[:rank])
    mine = {n: v[lo : lo + sizes[rank]] if v.ndim > 1 else v for n, v in values.items()}
    args = {n: arrange(mine[n], kind, dtype) for n in set(FORWARD) | set(BACKWARD)}
    for name in absent:
        args[name] = None
    if inference:  # running statistics made under torch.inference_mode(): moved all the same
        with torch.inference_mode():
            args.update((n, args[n].clone()) for n in ("running_mean", "running_var"))
    if rank == bad_rank and fault == "form":
        args[target] = arrange(mine[target], form, dtype)
    elif rank == bad_rank and fault == "kind":
        args[target] = arrange(mine[target], "numpy" if kind == "torch" else "torch", dtype)
    elif rank == bad_rank and fault == "alias" and entry == "forward":
        source = args[alias]
        if alias == "input" and source.shape[0]:
            source = source[0].reshape(source.shape[1], -1)[:, 0]  # a view of the input
        args["running_mean"] = source
    elif rank == bad_rank and fault == "channels":
        shape = list(mine[target].shape)
        shape[1 if len(shape) > 1 else 0] += 1
        args[target] = arrange(np.ones(shape), kind, dtype)
    elif rank == bad_rank and fault == "scalar":
        scalars[bad_scalar] = bad_value
    return dict(entry=entry, args=args, scalars=scalars, sizes=sizes, lo=lo, rank=rank)


def call(case: dict, group) -> tuple:
    a, s = case["args"], case["scalars"]
    if case["entry"] == "forward":
        outputs = sync_batch_norm_forward_training(
            *(a[n] for n in FORWARD), group=group, eps=s["eps"], momentum=s["momentum"]
        )
        return (*outputs, a["running_mean"], a["running_var"])
    return sync_batch_norm_backward(
        *(a[n] for n in BACKWARD), group=group, output_mask=s["output_mask"]
    )


def _tolerance(args: dict, names) -> float:
    dtypes = {str(args[n].dtype) for n in names if f64(args[n]) is not None}
    return max((TOL[np.dtype(d.removeprefix("torch."))] for d in dtypes), default=1e-10)


def _close(name: str, got, want, tol: float) -> None:
    got = f64(got)
    want = np.asarray(want, np.float64)
    if got is None or got.shape != want.shape:
        raise violation("wrong", f"{name}: got {got!r}, torch has shape {want.shape}")
    if not np.allclose(got, want, atol=tol, rtol=tol, equal_nan=True):
        raise violation("wrong", f"{name}: {got} differs from torch's {want}")


def check_results(case: dict, got: tuple, values: dict) -> None:
    """``got`` against PyTorch's float64 on the global batch (``values``: float64 copies of
    the arrays as passed, the data of every rank)."""
    a, s, lo = case["args"], case["scalars"], case["lo"]
    hi = lo + case["sizes"][case["rank"]]
    n = sum(case["sizes"])
    x = values["input"]
    constant = case["entry"] == "forward" and s["eps"] == 0 and n
    if constant and (np.ptp(x, axis=(0, *range(2, x.ndim))) == 0).any():
        COUNTS["undefined"] += 1  # a constant channel with eps 0: 0/0, torch's var is noise
        return
    if case["entry"] == "forward":
        tol = _tolerance(a, FORWARD)
        if n == 0:
            _close("output", got[0], np.zeros(x[lo:hi].shape), tol)
            for i, name in ((3, "running_mean"), (4, "running_var")):
                if got[i] is not None:
                    _close(name, got[i], values[name], tol)
            return
        v = {k: values[k] for k in FORWARD}
        want = _torch_training(v, s["momentum"], s["eps"])
        want[0] = want[0][lo:hi]
        for i, name in enumerate(("output", "saved_mean", "saved_invstd", *FORWARD[3:])):
            if want[i] is not None:
                _close(name, got[i], want[i], tol)
        return
    tol = _tolerance(a, BACKWARD)
    w = values["weight"] if values["weight"] is not None else np.ones(values["input"].shape[1])
    saved = dict(mode="saved", mean=values["saved_mean"], invstd=values["saved_invstd"])
    mask = s["output_mask"]
    if mask[0] and n:
        dx = reference(values["input"], values["grad_output"], w, **saved)[0]
        _close("grad_input", got[0], dx.numpy()[lo:hi], tol)
    if a["weight"] is None and got[1] is not None:
        raise violation("wrong", "weight None but grad_weight came back")
    if hi > lo:
        local = reference(values["input"][lo:hi], values["grad_output"][lo:hi], w, **saved)
        sums = [g.numpy() for g in local[1:]]
    else:
        sums = [np.zeros(w.shape), np.zeros(w.shape)]
    for i, name in ((1, "grad_weight"), (2, "grad_bias")):  # a bias's without a weight too
        if mask[i] and (i == 2 or a["weight"] is not None):
            _close(name, got[i], sums[i - 1], tol)


def run_case(seed: int, comm, group) -> None:
    """One case on every rank of the mpi4py ``comm`` with ``group`` (``comm`` or a
    torch.distributed group of the same processes): the invariants, checked on every rank."""
    case = draw_case(seed, comm.size, comm.rank)
    args = case["args"]
    COUNTS["examples"] += 1
    COUNTS[f"calls_{case['entry']}"] += 1
    before = {n: snapshot(a) for n, a in args.items()}
    mine = {n: f64(a) for n, a in args.items()}
    try:
        got, status = call(case, group), 0
    except InfiniError as exc:
        got, status, error = None, int(exc.status), exc
    except Exception as exc:  # an escape: still tell the other ranks
        got, status, error = None, -1, exc
    statuses = comm.allgather(status)
    if status == -1:
        raise violation("escapes", f"rank {comm.rank}: {error!r}") from error
    if status == int(Status.INTERNAL_ERROR):
        raise violation("escapes", f"rank {comm.rank}: {error}") from error
    if len(set(statuses)) > 1:
        raise violation("wrong", f"ranks ended with statuses {statuses}")
    changed = [n for n, a in args.items() if snapshot(a) != before[n]]
    if status or any(statuses):
        COUNTS[f"refused_{Status(max(statuses)).name}"] += 1
        if changed:
            raise violation("half_writes", f"rank {comm.rank} changed {changed} ({statuses})")
        return
    COUNTS["accepted"] += 1
    written = ("running_mean", "running_var") if case["entry"] == "forward" else ()
    if set(changed) - set(written):
        raise violation("half_writes", f"changed {changed}, which it only reads")
    # The reference's operands: the global data as the ranks passed it, this rank's own
    # per-channel arrays (a faulty rank's accepted forms change no values the others see).
    values = dict(mine)
    for name in ("input", "grad_output"):
        parts = comm.allgather(mine[name])
        values[name] = None if any(p is None for p in parts) else np.concatenate(parts)
    check_results(case, got, values)
    COUNTS["results_checked"] += 1


@SETTINGS
@given(st.integers(0, 2**32 - 1))
def fuzz_alone(seed: int) -> None:
    null = seed % 16 == 0  # a null (or freed) communicator: refused as a bad group
    run_case(seed, MPI.COMM_SELF, MPI.COMM_NULL if null else MPI.COMM_SELF)


def _gloo(comm) -> object:
    """A torch.distributed gloo group of ``comm``'s processes, over 127.0.0.1."""
    import socket

    import torch.distributed as dist

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = comm.bcast(free_port() if comm.rank == 0 else None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size
    )
    return dist.group.WORLD


def lockstep(seconds: float) -> None:
    """Under ``mpiexec``: rank 0 draws the seeds and ends the run; counts summed on rank 0."""
    comm, rng = MPI.COMM_WORLD, np.random.default_rng()
    groups = [comm, _gloo(comm)]
    deadline = time.monotonic() + seconds
    while True:
        go = comm.bcast(time.monotonic() < deadline if comm.rank == 0 else None)
        if not go:
            break
        seed = comm.bcast(int(rng.integers(0, 2**32)) if comm.rank == 0 else None)
        try:
            run_case(seed, comm, groups[seed % 2])
        except AssertionError as exc:  # every rank saw the same verdicts; report and go on
            print(f"rank {comm.rank}, seed {seed}: {exc}", flush=True)
    totals = comm.reduce(COUNTS, op=MPI.SUM)
    if comm.rank == 0:
        import json

        print("FUZZ " + json.dumps(dict(totals), sort_keys=True), flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    if MPI.COMM_WORLD.size > 1:
        lockstep(float(sys.argv[1]))
    else:
        child_main(fuzz_alone, lambda: None)
