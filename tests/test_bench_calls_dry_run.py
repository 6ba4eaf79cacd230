"""``benchmarks/bench_calls.py --quick``: the per-call benchmark runs end to end on one tiny
problem, so that it cannot rot between real runs: every way and pass on the CPU with its
accuracy check, the NVIDIA path on the stand-ins, the batched backward, each target ratio
judged, the Markdown and the JSON; and it refuses to write dry numbers into
benchmarks/results."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_calls.py"
PASSES = {"forward_training", "forward_inference", "backward_train", "backward_saved"}


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=REPO, env=env
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("calls")
    result = run("--quick", "--out", str(out))
    assert result.returncode == 0, result.stderr
    (md,) = out.glob("calls-*.md")
    return json.loads(md.with_suffix(".json").read_text()), md.read_text()


def sections(report: dict, prefix: str) -> list[dict]:
    return [s for s in report["sections"] if s["title"].startswith(prefix)]


def test_every_pass_every_way_on_the_cpu_checked_against_torch(report):
    data, md = report
    assert data["meta"]["quick"] and "QUICK DRY RUN" in md
    (cpu,) = sections(data, "CPU: array API")
    assert cpu["threads"] == 1 and all(cpu["loadavg"])
    assert {r["pass"] for r in cpu["rows"]} == PASSES
    for row in cpu["rows"]:
        assert set(row["ways"]) == {"array", "array_out", "compute", "capi", "torch"}
        for way in row["ways"].values():
            assert way["within_tolerance"] and way["max_abs_diff"] < 1e-4, row
            assert way["min_us"] <= way["median_us"] <= way["max_us"]
        (target,) = [r for r in row["ratios"] if r["target"] is not None]
        assert target["name"] == "array / torch" and target["target"] == 1.5
        assert isinstance(target["met"], bool)


def test_the_batched_backward_against_one_folded_call(report):
    data, _ = report
    (batched,) = sections(data, "CPU: batched")
    (row,) = batched["rows"]
    assert row["shape"][0] == 64 and set(row["ways"]) == {"batched", "unbatched"}
    assert row["ways"]["batched"]["within_tolerance"]
    assert row["ratios"][0]["name"] == "batched / unbatched" and row["ratios"][0]["target"] == 2


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the stub libcudnn")
def test_the_nvidia_path_on_the_stand_ins(report):
    data, md = report
    (nvidia,) = sections(data, "NVIDIA path")
    assert {r["pass"] for r in nvidia["rows"]} == PASSES
    for row in nvidia["rows"]:
        assert set(row["ways"]) == {"array", "array_out", "compute", "torch"}
        targets = {r["name"]: r["target"] for r in row["ratios"]}
        assert targets == {
            "array / compute": 1.5,
            "array / torch": 2.0,
            "array_out / compute": None,  # every output given: nothing allocated per call
            "array / compute less stand-in": None,  # the CuPy stand-in's own time out
            "array / torch less stand-in": None,
            "array_out / compute less stand-in": None,
        }
        assert row["stand_ins_us"]["array"] > 0 and row["stand_ins_us"]["array_out"] > 0
    assert sections(data, "NVIDIA stand-ins: batched")[0]["rows"]
    assert "loadavg before" in md and "met" in md


def test_quick_run_refuses_the_results_folder():
    result = run("--quick")
    assert result.returncode != 0 and "--quick writes no results" in result.stderr
