"""``benchmarks/bench_bn.py --dry-run``: every table, the JSON and the plot, without a GPU.

The dry run's placeholder times must never pass for measurements: each file says so, the
JSON says ``dry_run``, and the bench refuses to write them into ``benchmarks/results``.
The measuring code itself runs here too, on the CPU (torch CPU tensors, NumPy for CuPy,
cudnn_bn's NumPy engine), so that a GPU run does not find its first bug.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_bn.py"
LABEL = "DRY RUN — not measurements"
PASS_NAMES = ["backward", "forward_training", "forward_inference"]


def _load(name: str) -> object:
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


bench = _load("bench_bn")
report_lib = _load("bench_report")
CASE_NAMES = [case.name for case in bench.CASES]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def _one(out: Path, suffix: str) -> Path:
    (path,) = out.glob(f"*{suffix}")
    return path


def test_writes_markdown_and_json(dry_run: Path) -> None:
    assert _one(dry_run, ".md").name.startswith("dry-run-")
    assert _one(dry_run, ".json").stem == _one(dry_run, ".md").stem


def test_the_passes_are_the_ones_the_bench_measures() -> None:
    assert list(report_lib.PASSES) == PASS_NAMES
    assert report_lib.PASSES["forward_training"].checks["running"] == (
        "running_mean",
        "running_var",
    )
    for spec in report_lib.PASSES.values():
        assert {"ours_api", "ours_compute", "torch_cudnn", "torch_native"} <= set(spec.impls)
        assert "ours_compute" in spec.host_impls
        assert {"torch_cudnn", "torch_native"} <= set(spec.host_impls)
    assert "ours_graph" in report_lib.PASSES["forward_training"].impls


def test_markdown_is_labelled_and_has_every_case_and_pass(dry_run: Path) -> None:
    text = _one(dry_run, ".md").read_text()
    # the banner; per pass times, ratios, bandwidth, correctness (+ graph); host overhead
    assert text.count(LABEL) >= 1 + 5 + 5 + 4 + 3
    for name in CASE_NAMES:
        assert name in text
    for spec in report_lib.PASSES.values():
        assert f"## {spec.title}" in text
        assert f"## Host overhead, {spec.title}" in text
        for label in spec.impls.values():
            assert label in text
    for section in ("Ours over PyTorch", "Effective bandwidth", "Correctness", "CUDA graph"):
        assert text.count(section) >= 2
    assert text.count("### CUDA graph") == 2  # backward and forward training
    assert "y / mean,invstd / running_mean,running_var" in text
    assert "largest case's 20 GiB budget" in text


def test_json_has_every_case_pass_and_implementation(dry_run: Path) -> None:
    report = json.loads(_one(dry_run, ".json").read_text())  # strict: no NaN
    assert report["dry_run"] is True
    assert report["label"] == LABEL
    assert "nothing was measured" in report["dry_run_note"]
    assert list(report["passes"]) == PASS_NAMES
    assert [(r["name"], r["pass"]) for r in report["rows"]] == [
        (name, p) for name in CASE_NAMES for p in PASS_NAMES
    ]
    for row in report["rows"]:
        spec = report_lib.PASSES[row["pass"]]
        assert report["passes"][row["pass"]]["impls"] == spec.impls
        assert set(row["impls"]) == set(spec.impls)
        for entry in row["impls"].values():
            assert entry["status"] == "ok"
            assert entry["median_ms"] == bench.DRY_RUN_MS  # the placeholder, never a measurement
            assert entry["runs"] >= 50
        assert row["ratios"]["ours_api/torch_cudnn"] == 1.0
        assert row["ratios"]["ours_compute/torch_native"] == 1.0
        assert ("ours_graph/torch_cudnn" in row["ratios"]) == ("ours_graph" in spec.impls)
        assert row["copy"]["median_ms"] == bench.DRY_RUN_MS
        case = next(c for c in bench.CASES if c.name == row["name"])
        assert row["bytes_moved"] == spec.moved_tensors * case.nbytes
    host = report["host_overhead"]
    assert [h["pass"] for h in host] == PASS_NAMES
    for h in host:
        assert set(h["impls"]) == set(report_lib.PASSES[h["pass"]].host_impls)
        assert h["case"] == bench.TINY.name
    assert report["environment"]["command"].endswith("--dry-run --out " + str(dry_run))


def test_pass_subset(tmp_path: Path) -> None:
    proc = _run(
        "--dry-run",
        "--out",
        str(tmp_path),
        "--cases",
        "tiny_f32_1x16x16",
        "--passes",
        "forward_inference,forward_training",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(_one(tmp_path, ".json").read_text())
    chosen = ["forward_training", "forward_inference"]  # in the bench's order
    assert list(report["passes"]) == chosen
    assert [r["pass"] for r in report["rows"]] == chosen
    assert [h["pass"] for h in report["host_overhead"]] == chosen
    text = _one(tmp_path, ".md").read_text()
    assert report_lib.PASSES["backward"].title not in text
    assert "torch_autograd" not in text
    for p in chosen:
        assert f"## {report_lib.PASSES[p].title}" in text
    for bad in ("forward", "backward,nope", ","):
        proc = _run("--dry-run", "--passes", bad)
        assert proc.returncode != 0
        assert "--passes" in proc.stderr


def test_dry_run_imports_no_gpu_library(tmp_path: Path) -> None:
    code = (
        "import sys; sys.argv = ['bench_bn.py', '--dry-run', '--out', sys.argv[1]]; "
        f"sys.path.insert(0, {str(BENCH.parent)!r}); import bench_bn; bench_bn.main(sys.argv[1:]); "
        "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_dry_run_defaults_to_a_temporary_folder() -> None:
    proc = _run("--dry-run", "--cases", "tiny_f32_1x16x16")
    assert proc.returncode == 0, proc.stderr
    written = [Path(line) for line in proc.stdout.split()]
    assert written
    assert all(bench.DEFAULT_OUT not in path.parents for path in written)


def test_dry_run_refuses_the_results_folder() -> None:
    for extra in ([], ["--passes", "forward_training"]):
        proc = _run("--dry-run", "--out", str(bench.DEFAULT_OUT), *extra)
        assert proc.returncode != 0
        assert "benchmarks/results" in proc.stderr


def test_case_subset_and_run_count(tmp_path: Path) -> None:
    proc = _run("--dry-run", "--out", str(tmp_path), "--cases", "tiny_f32_1x16x16", "--runs", "60")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(_one(tmp_path, ".json").read_text())
    assert {r["name"] for r in report["rows"]} == {"tiny_f32_1x16x16"}
    assert all(r["impls"]["ours_api"]["runs"] == 60 for r in report["rows"])
    assert _run("--dry-run", "--runs", "10").returncode != 0


def test_largest_case_fits_the_budget() -> None:
    case, lines = bench.largest_case()
    numel = case.nbytes // 4
    assert numel <= 2**31 - 1
    assert bench.PEAK_TENSORS * case.nbytes + bench.FLUSH_BYTES <= bench.BUDGET
    assert any(str(case.shape[0]) in line for line in lines)


def _report(rows: list[dict], host: list[dict]) -> dict:
    return {
        "label": "measurements",
        "dry_run": False,
        "environment": {"device": "test"},
        "method": [],
        "passes": {p: report_lib.PASSES[p].to_json() for p in PASS_NAMES},
        "rows": [report_lib.json_safe(r) for r in rows],
        "host_overhead": host,
        "largest_case_budget": [],
    }


def test_unavailable_implementations_are_reported() -> None:
    plot_results = _load("plot_results")
    case = bench.TINY
    rows = []
    for p, spec in report_lib.PASSES.items():
        raw = {key: {"samples": [2.0] * 50} for key in spec.impls}
        raw["torch_cudnn"] = {"error": f"RuntimeError: cuDNN refuses BF16 in {p}"}
        raw["ours_api"]["y_max_abs_diff"] = 0.125
        rows.append(report_lib.summarize_row(case, p, {"samples": [1.0] * 50}, raw, {}))
    for entry in rows:
        assert entry["impls"]["torch_cudnn"]["status"] == "unavailable"
        assert entry["ratios"]["ours_api/torch_cudnn"] is None
        assert entry["ratios"]["ours_api/torch_native"] == 1.0
    # backward moves 3 tensors, a forward 2, against a copy of 3 (counted twice) in half time
    assert rows[0]["impls"]["ours_api"]["bandwidth_fraction"] == pytest.approx(0.25)
    assert rows[1]["impls"]["ours_api"]["bandwidth_fraction"] == pytest.approx(1 / 6)
    impls = {
        "ours_compute": {"us_per_call": 3.0},
        "torch_cudnn": {"us_per_call": 6.0},
        "torch_native": {"error": "boom"},
    }
    host = [{"pass": "forward_training", "case": case.name, "calls": 1000, "impls": impls}]
    text = plot_results.render_markdown(_report(rows, host))
    for p in PASS_NAMES:
        assert f"cuDNN refuses BF16 in {p}" in text
    assert "unavailable: boom" in text
    assert "| ours_compute | 3.00 | 0.50 | n/a |" in text
    assert "| 0.125 / n/a / n/a |" in text  # forward training: y / stats / running
    assert "| 0.125 |" in text  # forward inference: y


def test_plot(dry_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert _one(dry_run, ".png").stat().st_size > 0  # the bench drew it itself
    copy = tmp_path / "results.json"
    copy.write_text(_one(dry_run, ".json").read_text())
    plot_results = _load("plot_results")
    assert plot_results.main([str(copy), "--markdown"]) == 0
    assert (tmp_path / "results.png").stat().st_size > 0
    assert LABEL in (tmp_path / "results.md").read_text()


def test_plot_of_a_pass_subset(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    proc = _run("--dry-run", "--out", str(tmp_path), "--passes", "forward_training")
    assert proc.returncode == 0, proc.stderr
    assert _one(tmp_path, ".png").stat().st_size > 0


# ---------------------------------------------------------------- the measuring code, on the CPU


class _CpuStream:
    ptr = 0

    def synchronize(self) -> None:
        pass

    def begin_capture(self) -> None:
        raise RuntimeError("no CUDA graph on the CPU")


class _NumpyAsCupy:
    from_dlpack = staticmethod(np.from_dlpack)


@pytest.fixture
def cpu_bench(monkeypatch: pytest.MonkeyPatch) -> object:
    """A ``Bench`` on the CPU: wall-clock times, no pools, torch CPU tensors."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "HOST_CALLS", 3)

    class CpuBench(bench.Bench):
        def __init__(self) -> None:
            self.cp, self.torch, self.runs, self.warmup = _NumpyAsCupy, torch, 3, 1
            self.stream, self.flush_buf, self.peak = _CpuStream(), None, 0

        def release(self) -> None:
            pass

        def time(self, fn: object) -> list[float]:
            fn()
            times = []
            for _ in range(self.runs):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return times

        def copy_times(self, nbytes: int) -> list[float]:
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            return self.time(lambda: dst.copy_(src))

    return CpuBench()


@pytest.mark.parametrize("layout", ["NCL", "NHWC"])
def test_measuring_code_on_the_cpu(cpu_bench: object, layout: str) -> None:
    """Every pass through the real measuring code: ours and PyTorch's CPU kernels agree,
    cuDNN's and the graph's absence is recorded, never raised."""
    shape = (4, 3, 5) if layout == "NCL" else (2, 3, 4, 5)
    case = bench.Case(f"cpu_{layout}", shape, "f32", layout)
    rows = bench.measure_case(case, cpu_bench, PASS_NAMES)
    assert [r["pass"] for r in rows] == PASS_NAMES
    for row in rows:
        spec = report_lib.PASSES[row["pass"]]
        assert row["reference"] == spec.impls["torch_native"]  # cuDNN: not on the CPU
        assert row["engine"] == "numpy"
        for key, entry in row["impls"].items():
            if key in ("torch_cudnn", "ours_graph"):
                assert entry["status"] == "unavailable", key
                assert entry["error"]
                continue
            assert entry["status"] == "ok", (row["pass"], key, entry.get("error"))
            diffs = {k: v for k, v in entry.items() if k.endswith("_max_abs_diff")}
            assert diffs, (row["pass"], key)
            assert all(v < 1e-5 for v in diffs.values()), (row["pass"], key, diffs)
        if row["pass"] == "forward_training":
            for key in ("ours_api", "ours_compute", "torch_native", "torch_functional"):
                assert "running_max_abs_diff" in row["impls"][key], key
            assert "stats_max_abs_diff" in row["impls"]["ours_api"]
            assert "stats_max_abs_diff" not in row["impls"]["torch_functional"]
    json.dumps(report_lib.json_safe(rows), allow_nan=False)


def test_training_implementations_own_their_running_statistics(cpu_bench: object) -> None:
    torch = cpu_bench.torch
    t = bench.make_tensors(bench.TINY, torch, "forward_training")
    makers = {
        "ours_api": bench.ours_api("forward_training", t, cpu_bench),
        **bench.torch_impls("forward_training", t, torch),
    }
    impls = {key: make() for key, make in makers.items()}
    impls["ours_compute"] = bench.OursCompute("forward_training", t, cpu_bench).eager()
    buffers = [t["rm"], t["rv"]]
    for impl in impls.values():
        buffers += [impl.running.mean, impl.running.var]
    assert len({b.data_ptr() for b in buffers}) == len(buffers)
    for key, impl in impls.items():
        if key != "torch_cudnn":  # not on the CPU
            impl.fn()
            assert not torch.equal(impl.running.mean, t["rm"]), key  # updated, in its own
    assert torch.equal(t["rm"], torch.zeros_like(t["rm"]))  # the starting values: untouched
    for impl in impls.values():
        impl.running.reset()
        assert torch.equal(impl.running.mean, t["rm"])


def test_host_overhead_on_the_cpu(cpu_bench: object) -> None:
    for p, spec in report_lib.PASSES.items():
        out = bench.host_overhead(cpu_bench, p)
        assert list(out) == list(spec.host_impls)
        assert "error" in out["torch_cudnn"]
        for name in spec.host_impls:
            if name != "torch_cudnn":
                assert out[name]["us_per_call"] > 0, (p, name, out[name])
