"""Synchronized batch norm on real engines: ``mpiexec -n 2`` and ``-n 4`` (mpi4py, NumPy
arrays) and three torch.distributed gloo processes over 127.0.0.1 (torch CPU tensors); on a
GPU machine (``gpu`` tests) also CuPy arrays over MPI, and NCCL through CuPy and torch.

The fuzz target ``fuzz_distributed.py`` runs alone (a group of one) and under ``mpiexec -n
2`` (bad arguments on one rank), for a share of ``FUZZ_SECONDS``.

Each launch runs every case of ``distributed_worker.py`` once on every rank (one launch
checks many cases, to keep process start-up off the clock); each (launch, case) is one test
here, failing with the traceback of every rank where it failed. Launches are bounded in time
and their processes are ended if they overrun.
"""

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import distributed_worker
import pytest
from fuzzing import VIOLATIONS, budget, run_child

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
TIMEOUT = 120  # seconds per launch; a normal one takes a few
GPU = pytest.mark.gpu
LAUNCHES = [
    pytest.param("mpi", 2, id="mpi-2"),
    pytest.param("mpi", 4, id="mpi-4"),
    pytest.param("gloo", 3, id="gloo-3"),
    pytest.param("mpi-cupy", 2, id="mpi-cupy-2", marks=GPU),  # two ranks may share a GPU
    pytest.param("nccl-cupy", 2, id="nccl-cupy-2", marks=GPU),  # NCCL: one GPU per rank
    pytest.param("nccl-torch", 2, id="nccl-torch-2", marks=GPU),
]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores
    return env


def mpiexec() -> str | None:
    """The ``mpiexec`` beside this interpreter (the ``mpich`` wheel's), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(processes: list[subprocess.Popen], timeout: float = TIMEOUT) -> str:
    """Everything the processes printed; ends them all if the launch overruns."""
    output = []
    try:
        for process in processes:
            output.append(process.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
            process.communicate()
        pytest.fail(f"the launch ran past {timeout} s:\n" + "\n".join(output))
    return "\n".join(output)


def launch(engine: str, ranks: int, out: Path) -> str:
    """Start the worker on ``ranks`` processes, wait for all, return their output."""
    common = dict(
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if engine == "gloo":
        port, processes = _free_port(), []
        for rank in range(ranks):
            env = {**_environment(), "RANK": str(rank), "WORLD_SIZE": str(ranks)}
            env["MASTER_PORT"] = str(port)
            command = [sys.executable, str(WORKER), engine, str(out)]
            processes.append(subprocess.Popen(command, env=env, **common))
        return _wait(processes)
    command = [mpiexec(), "-n", str(ranks), sys.executable, str(WORKER), engine, str(out)]
    return _wait([subprocess.Popen(command, env=_environment(), **common)])


@functools.cache
def results(engine: str, ranks: int, out: Path) -> tuple[list[dict], str]:
    """Each rank's results of one launch (run once per session), and what it printed."""
    out.mkdir(parents=True, exist_ok=True)
    output = launch(engine, ranks, out)
    return [_read(out / f"rank-{rank}.json") for rank in range(ranks)], output


def _read(path: Path) -> dict:
    """A rank's results; empty where it never wrote them, or died while writing."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@pytest.fixture(scope="session")
def launches_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distributed")


def _requirements(engine: str, ranks: int = 1) -> None:
    if engine.startswith("nccl"):
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < ranks:
            pytest.skip(f"NCCL needs a GPU per rank: {ranks} ranks")
    if engine != "gloo":
        pytest.importorskip("mpi4py", reason="the test extra installs mpi4py and mpich")
        if mpiexec() is None:
            pytest.skip("no mpiexec (the test extra's mpich wheel provides one)")
    else:
        pytest.importorskip("torch.distributed")


@pytest.mark.parametrize("case", list(distributed_worker.CASES))
@pytest.mark.parametrize(("engine", "ranks"), LAUNCHES)
def test_case_on_every_rank(engine, ranks, case, launches_dir):
    _requirements(engine, ranks)
    per_rank, output = results(engine, ranks, launches_dir / f"{engine}-{ranks}")
    missing = [rank for rank, got in enumerate(per_rank) if case not in got]
    assert not missing, f"ranks {missing} did not report {case!r}; the launch printed:\n{output}"
    failures = {rank: got[case] for rank, got in enumerate(per_rank) if got[case]}
    assert not failures, "\n".join(f"--- rank {r}:\n{tb}" for r, tb in failures.items())


def test_measured_numbers_are_reported(launches_dir):
    """The agreement with single-process batch norm and the bytes per pass, for the record
    (``pytest -s`` shows them)."""
    _requirements("mpi")
    per_rank, output = results("mpi", 4, launches_dir / "mpi-4")
    numbers = [got.get("numbers", {}) for got in per_rank]
    assert all(numbers), output
    for key in numbers[0]:
        print(f"{key}: {max(n[key] for n in numbers)}")
    assert max(n["f64 max error"] for n in numbers) < 1e-12


# --- the data-parallel example -----------------------------------------------------------------

LOSS_ROW = re.compile(r"\s*(\d+)\s+(\d+\.\d+)")


def _loss_table(output: str) -> dict[int, float]:
    return {
        int(m.group(1)): float(m.group(2))
        for line in output.splitlines()
        if (m := LOSS_ROW.fullmatch(line))
    }


def test_training_example_under_mpiexec_follows_the_single_process_loss_curve():
    """``mpiexec -n 2 examples/train_distributed.py`` prints the loss curve of
    ``examples/train_mnist_like.py`` (one process, the same global batches), to rounding."""
    _requirements("mpi")
    common = dict(
        cwd=ROOT,
        env=_environment(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    examples = ROOT / "examples"
    command = [sys.executable, str(examples / "train_distributed.py")]
    distributed = subprocess.run([mpiexec(), "-n", "2", *command], **common)
    single = subprocess.run([sys.executable, str(examples / "train_mnist_like.py")], **common)
    for run in (distributed, single):
        assert run.returncode == 0 and "PASSED" in run.stdout, run.stdout + run.stderr
    assert "2 ranks" in distributed.stdout, distributed.stdout
    curve, expected = _loss_table(distributed.stdout), _loss_table(single.stdout)
    assert len(expected) > 5 and curve.keys() == expected.keys(), distributed.stdout
    for step, loss in expected.items():  # printed to 4 decimals
        assert abs(curve[step] - loss) <= 1.5e-4, (step, curve[step], loss)


# --- fuzzing -------------------------------------------------------------------------------------

FUZZ_SECONDS = 8.0  # each of the two runs, unless FUZZ_SECONDS shares out more


def _no_violations(counts: dict) -> None:
    print(counts)
    assert {v: counts.get(v, 0) for v in VIOLATIONS} == dict.fromkeys(VIOLATIONS, 0), counts
    assert counts["examples"] > 0, counts


def test_fuzz_in_a_group_of_one():
    pytest.importorskip("hypothesis")
    _requirements("mpi")
    _no_violations(run_child("fuzz_distributed", budget(FUZZ_SECONDS * 2) / 2))


def test_fuzz_on_two_ranks_with_bad_arguments_on_one():
    _requirements("mpi")
    seconds = budget(FUZZ_SECONDS * 2) / 2
    env = _environment()
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env["PYTHONPATH"]])
    target = WORKER.parent / "fuzz_distributed.py"
    command = [mpiexec(), "-n", "2", sys.executable, str(target), str(seconds)]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = _wait([process], timeout=seconds + TIMEOUT)
    assert process.returncode == 0, output[-8000:]
    line = [x for x in output.splitlines() if x.startswith("FUZZ ")][-1]
    _no_violations(json.loads(line[len("FUZZ ") :]))
