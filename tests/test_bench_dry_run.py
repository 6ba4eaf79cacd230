"""``benchmarks/bench_bn.py --dry-run``: every table, the JSON and the plot, without a GPU.

The dry run's placeholder times must never pass for measurements: each file says so, the
JSON says ``dry_run``, and the bench refuses to write them into ``benchmarks/results``.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_bn.py"
LABEL = "DRY RUN — not measurements"


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


def test_markdown_is_labelled_and_has_every_case(dry_run: Path) -> None:
    text = _one(dry_run, ".md").read_text()
    assert text.count(LABEL) >= 7  # the banner and each table of figures
    for name in CASE_NAMES:
        assert name in text
    for section in ("Ours over PyTorch", "Effective bandwidth", "Host overhead", "CUDA graph"):
        assert section in text
    assert "largest case's 20 GiB budget" in text


def test_json_has_every_case_and_implementation(dry_run: Path) -> None:
    report = json.loads(_one(dry_run, ".json").read_text())  # strict: no NaN
    assert report["dry_run"] is True
    assert report["label"] == LABEL
    assert "nothing was measured" in report["dry_run_note"]
    assert [case["name"] for case in report["cases"]] == CASE_NAMES
    for case in report["cases"]:
        assert set(case["impls"]) == set(bench.IMPLS)
        for entry in case["impls"].values():
            assert entry["status"] == "ok"
            assert entry["median_ms"] == bench.DRY_RUN_MS  # the placeholder, never a measurement
            assert entry["runs"] >= 50
        assert case["ratios"]["ours_api/torch_cudnn"] == 1.0
        assert case["copy"]["median_ms"] == bench.DRY_RUN_MS
    assert set(report["host_overhead"]["impls"]) == set(bench.HOST_IMPLS)
    assert report["environment"]["command"].endswith("--dry-run --out " + str(dry_run))


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
    proc = _run("--dry-run", "--out", str(bench.DEFAULT_OUT))
    assert proc.returncode != 0
    assert "benchmarks/results" in proc.stderr


def test_case_subset_and_run_count(tmp_path: Path) -> None:
    proc = _run("--dry-run", "--out", str(tmp_path), "--cases", "tiny_f32_1x16x16", "--runs", "60")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(_one(tmp_path, ".json").read_text())
    assert [c["name"] for c in report["cases"]] == ["tiny_f32_1x16x16"]
    assert report["cases"][0]["impls"]["ours_api"]["runs"] == 60
    assert _run("--dry-run", "--runs", "10").returncode != 0


def test_largest_case_fits_the_budget() -> None:
    case, lines = bench.largest_case()
    numel = case.nbytes // 4
    assert numel <= 2**31 - 1
    assert bench.PEAK_TENSORS * case.nbytes + bench.FLUSH_BYTES <= bench.BUDGET
    assert any(str(case.shape[0]) in line for line in lines)


def test_unavailable_implementations_are_reported() -> None:
    plot_results = _load("plot_results")
    case = bench.TINY
    raw = {key: {"samples": [2.0] * 50} for key in bench.IMPLS}
    raw["torch_cudnn"] = {"error": "RuntimeError: cuDNN refuses BF16"}
    entry = bench.summarize_case(case, {"samples": [1.0] * 50}, raw, {"engine": "cudnn"})
    assert entry["impls"]["torch_cudnn"]["status"] == "unavailable"
    assert entry["ratios"]["ours_api/torch_cudnn"] is None
    assert entry["ratios"]["ours_api/torch_native"] == 1.0
    assert entry["impls"]["ours_api"]["bandwidth_fraction"] == pytest.approx(0.25)
    report = {
        "label": "measurements",
        "dry_run": False,
        "environment": {"device": "test"},
        "method": [],
        "impls": bench.IMPLS,
        "cases": [bench.json_safe(entry)],
        "host_overhead": {"case": case.name, "calls": 1000, "impls": {"x": {"error": "boom"}}},
        "largest_case_budget": [],
    }
    text = plot_results.render_markdown(report)
    assert "cuDNN refuses BF16" in text
    assert "unavailable: boom" in text


def test_plot(dry_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert _one(dry_run, ".png").stat().st_size > 0  # the bench drew it itself
    copy = tmp_path / "results.json"
    copy.write_text(_one(dry_run, ".json").read_text())
    plot_results = _load("plot_results")
    assert plot_results.main([str(copy), "--markdown"]) == 0
    assert (tmp_path / "results.png").stat().st_size > 0
    assert LABEL in (tmp_path / "results.md").read_text()
