"""What ``bench_bn.py`` measures and how its figures are written; imports no GPU library.

The passes and their implementations, figures from raw samples (medians, ratios, bandwidth
fractions, differences from the reference), the environment, and the JSON, Markdown and plot
files (``plot_results.py`` renders the last two from the JSON alone).
"""

import contextlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
DRY_RUN_MS, DRY_RUN_US = 1.0, 1.0  # the placeholder every dry-run time is set to
COPY_TENSORS = 3  # the copy measured per case moves x+dy+dx bytes, read once and written once
CUDNN_WHEELS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
OURS = ("ours_api", "ours_compute", "ours_graph")


@dataclass(frozen=True)
class Pass:
    """One batch-norm pass: its implementations, what a call moves, what is compared."""

    title: str
    moved_tensors: int  # x-sized tensors a call reads or writes at the least
    moved_text: str
    impls: dict[str, str]  # key: label; keys starting "ours_" are ours
    outputs: tuple[str, ...]  # the names of a call's results, in order
    checks: dict[str, tuple[str, ...]]  # column: the outputs whose max abs diff it shows
    host_impls: tuple[str, ...]

    @property
    def theirs(self) -> tuple[str, ...]:
        return tuple(k for k in self.impls if not k.startswith("ours_"))

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "bytes_moved": self.moved_text,
            "impls": self.impls,
            "checks": {k: ",".join(v) for k, v in self.checks.items()},
        }


_HOST_OURS = ("ours_api (CuPy arrays)", "ours_api (torch tensors)", "ours_compute")
PASSES = {
    "backward": Pass(
        "Backward (saved mean/invstd)",
        3,
        "x and dy read, dx written",
        {
            "ours_api": "cudnn_bn batch_norm_backward (array API)",
            "ours_compute": "cudnn_bn BatchNormBackwardDescriptor.compute",
            "ours_graph": "cudnn_bn backward compute, CUDA graph replay",
            "torch_cudnn": "torch cudnn_batch_norm_backward",
            "torch_native": "torch native_batch_norm_backward",
            "torch_autograd": "torch autograd (F.batch_norm)",
        },
        ("dx", "dw", "db"),
        {"dx": ("dx",), "dwdb": ("dw", "db")},
        (*_HOST_OURS, "torch_cudnn", "torch_native"),
    ),
    "forward_training": Pass(
        "Forward training (batch statistics, running statistics updated)",
        2,
        "x read, y written (the per-channel statistics are negligible)",
        {
            "ours_api": "cudnn_bn batch_norm_forward_training (array API)",
            "ours_compute": "cudnn_bn BatchNormForwardTrainingDescriptor.compute",
            "ours_graph": "cudnn_bn forward-training compute, CUDA graph replay",
            "torch_cudnn": "torch cudnn_batch_norm(training=True)",
            "torch_native": "torch native_batch_norm(training=True)",
            "torch_functional": "torch F.batch_norm(training=True)",
        },
        ("y", "mean", "invstd"),
        {"y": ("y",), "stats": ("mean", "invstd"), "running": ("running_mean", "running_var")},
        (*_HOST_OURS, "torch_cudnn", "torch_native", "torch_functional"),
    ),
    "forward_inference": Pass(
        "Forward inference (fixed running statistics)",
        2,
        "x read, y written",
        {
            "ours_api": "cudnn_bn batch_norm_forward_inference (array API)",
            "ours_compute": "cudnn_bn BatchNormForwardInferenceDescriptor.compute",
            "torch_cudnn": "torch cudnn_batch_norm(training=False)",
            "torch_native": "torch native_batch_norm(training=False)",
            "torch_functional": "torch F.batch_norm(training=False)",
        },
        ("y",),
        {"y": ("y",)},
        (*_HOST_OURS, "torch_cudnn", "torch_native", "torch_functional"),
    ),
}


# ---------------------------------------------------------------- figures from samples


def stats(samples: list[float]) -> dict[str, Any]:
    p10, median, p90 = np.percentile(samples, [10, 50, 90])
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90, "runs": len(samples)}


def summarize_row(case: Any, pass_name: str, copy: dict, raw: dict[str, dict], extra: dict) -> dict:
    """One row (a case in one pass) from raw samples: times, ratios, bandwidth, diffs."""
    spec = PASSES[pass_name]
    moved = spec.moved_tensors * case.nbytes
    entry = {
        "pass": pass_name,
        "name": case.name,
        "shape": list(case.shape),
        "dtype": case.dtype,
        "layout": case.layout,
        "bytes_moved": moved,
        **extra,
    }
    copy_bw = None
    if "samples" in copy:
        copy_bytes = COPY_TENSORS * case.nbytes
        entry["copy"] = {
            **stats(copy["samples"]),
            "bytes": copy_bytes,
            **{k: v for k, v in copy.items() if k != "samples"},
            "samples": copy["samples"],
        }
        copy_bw = 2 * copy_bytes / (entry["copy"]["median_ms"] * 1e-3)  # read + write
        entry["copy"]["bandwidth_gbps"] = copy_bw / 1e9
    else:
        entry["copy"] = {
            "status": "unavailable",
            "error": copy.get("error", "not run"),
            "measured_peak_bytes": copy.get("measured_peak_bytes"),
        }
    impls = {}
    for key in spec.impls:
        r = raw.get(key, {"error": "not run"})
        if "samples" not in r:
            impls[key] = {"status": "unavailable", "error": r.get("error", "not run")}
            continue
        s = stats(r["samples"])
        bw = moved / (s["median_ms"] * 1e-3)
        impls[key] = {
            "status": "ok",
            **s,
            "bandwidth_gbps": bw / 1e9,
            "bandwidth_fraction": bw / copy_bw if copy_bw else None,
            **{k: v for k, v in r.items() if k != "samples"},
            "samples": r["samples"],
        }
    entry["impls"] = impls
    entry["ratios"] = {
        f"{o}/{t}": impls[o]["median_ms"] / impls[t]["median_ms"]
        if impls[o]["status"] == impls[t]["status"] == "ok"
        else None
        for o in OURS
        if o in impls
        for t in spec.theirs
    }
    return entry


def dry_row(case: Any, pass_name: str, runs: int) -> dict:
    samples = [DRY_RUN_MS] * runs
    raw = {key: {"samples": samples} for key in PASSES[pass_name].impls}
    extra = {"engine": "n/a (dry run)", "reference": "n/a (dry run)", "measured_peak_bytes": None}
    return summarize_row(case, pass_name, {"samples": samples}, raw, extra)


def error_text(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and the first line of its message, at most ``limit`` characters."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:limit]}{'...' if len(first) > limit else ''}"


# ---------------------------------------------------------------- environment


def cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def driver_version() -> str:
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  ..."
    with contextlib.suppress(OSError, StopIteration):
        words = Path("/proc/driver/nvidia/version").read_text().split()
        return next(w for w in words if re.fullmatch(r"\d+\.\d+(\.\d+)?", w))
    with contextlib.suppress(Exception):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    return "unknown"


def dry_environment() -> dict:
    def installed(*names: str) -> str:
        for name in names:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return f"{name} {metadata.version(name)}"
        return "not installed"

    not_run = "n/a (dry run)"
    return {
        "device": "none (dry run)",
        "driver": not_run,
        "CUDA runtime (CuPy)": not_run,
        "cuDNN (cudnn_bn)": f"not loaded (dry run); {installed(*CUDNN_WHEELS)}",
        "CuPy": installed("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "torch": installed("torch"),
    }


def command_line() -> str:
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return prefix + shlex.join([Path(sys.executable).name, *sys.argv])


# ---------------------------------------------------------------- files


def json_safe(value: Any) -> Any:
    """NaN and infinities become null, so that the file is strict JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    return value


def write_report(report: dict, out: Path) -> list[Path]:
    """``<out>/<device>-<date>.json`` and ``.md``, and ``.png`` where matplotlib is here."""
    sys.path.insert(0, str(HERE))
    import plot_results

    slug = re.sub(r"[^a-z0-9]+", "-", report["environment"]["device"].lower()).strip("-")
    stem = out / f"{'dry-run' if report['dry_run'] else slug}-{report['environment']['date']}"
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    report = json_safe(report)
    json_path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    md_path.write_text(plot_results.render_markdown(report) + "\n")
    paths = [json_path, md_path]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            f"bench_bn: no matplotlib here; plot later with\n"
            f"  python3 benchmarks/plot_results.py {json_path}",
            file=sys.stderr,
        )
    else:
        paths.append(plot_results.plot(json_path))
    return paths
