"""First contact with the CPU engine: fresh processes, an empty numba cache, beside torch.

Run from the source tree: ``PYTHONPATH=. python benchmarks/bench_cold_start.py [--out DIR]
[--runs N] [--quick]``. Each run starts, in turn, three fresh interpreters:

- cudnn_bn, cold: an empty ``NUMBA_CACHE_DIR``; it imports the package, runs the README's
  first NumPy block as written (training forward, both backwards, inference: F32), then the
  first call of each pass in F16, BF16 and F64 (the README's shape), then one small call of
  each pass and dtype (the one-item kernels);
- cudnn_bn, warm: the same again with the cache the cold process filled;
- torch: the same passes on torch CPU tensors (``native_batch_norm``, its backward twice,
  ``F.batch_norm`` in eval mode), each dtype, the small calls.

Each stage's wall time comes from the child; each child's total wall time, CPU time (user +
system) and peak RSS from the parent (``os.wait4``). Reports medians over ``--runs`` runs,
with the load average, in ``<out>/cold-start-<date>.md`` and ``.json``. Targets (issue 18):
import + README block cold within 3x torch's, warm within 1x; each further dtype a few
seconds. ``--quick`` is a dry mode (tiny shapes, one run, the caller's numba cache) that a
test runs; it refuses to write into ``benchmarks/results``.
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = HERE / "results"
README_BLOCK = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)[
    0
]
TARGETS = {"cold": 3.0, "warm": 1.0}  # (import + README block) / torch's

# The stages after the README block; SHAPE and SMALL are filled in per mode.
OURS = """
import ml_dtypes
DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64, "f32": np.float32}

def passes(dtype, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(DTYPES[dtype])
    dy = rng.standard_normal(shape).astype(DTYPES[dtype])
    pc = np.float64 if dtype == "f64" else np.float32
    w, b = np.ones(shape[1], pc), np.zeros(shape[1], pc)
    rm, rv = np.zeros(shape[1], pc), np.ones(shape[1], pc)
    yield "forward_training", lambda: cudnn_bn.batch_norm_forward_training(x, w, b, rm, rv)
    yield "backward", lambda: cudnn_bn.batch_norm_backward(x, dy, w, None, None)
    yield "forward_inference", lambda: cudnn_bn.batch_norm_forward_inference(x, w, b, rm, rv)
"""
TORCH = """
import torch
import torch.nn.functional as F
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}
DTYPES["f32"] = torch.float32

def passes(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(DTYPES[dtype])
    dy = torch.randn(shape, generator=gen).to(DTYPES[dtype])
    pc = torch.float64 if dtype == "f64" else torch.float32
    w, b = torch.ones(shape[1], dtype=pc), torch.zeros(shape[1], dtype=pc)
    rm, rv = torch.zeros(shape[1], dtype=pc), torch.ones(shape[1], dtype=pc)
    saved = {}

    def training():
        saved["stats"] = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)[1:]

    yield "forward_training", training
    yield "backward", lambda: torch.ops.aten.native_batch_norm_backward(
        dy, x, w, rm, rv, *saved["stats"], True, 1e-5, [True] * 3
    )
    yield "forward_inference", lambda: F.batch_norm(x, rm, rv, w, b, False)

def readme_block():
    for name, run in passes("f32", (32, 64, 128)):
        run()
        if name == "backward":
            run()  # the README's second backward (recomputing the statistics)
"""
STAGES = """
stage("readme_block", readme_block)
for dtype in ("f16", "bf16", "f64"):
    for name, run in passes(dtype, SHAPE):
        stage(f"{dtype} {name}", run)

def small_calls():
    for dtype in DTYPES:
        for _, run in passes(dtype, SMALL):
            run()

stage("small calls, 4 dtypes", small_calls)
print(json.dumps(times))
"""
PRELUDE = """
import json, time
start = time.perf_counter()
times = {}

def stage(name, run):
    begin = time.perf_counter()
    run()
    times[name] = time.perf_counter() - begin
"""


def child_script(engine: str, quick: bool) -> str:
    """The code a fresh interpreter runs for ``engine`` (``cudnn_bn`` or ``torch``)."""
    shape, small = ((2, 3, 4), (2, 3)) if quick else ((32, 64, 128), (8, 4))
    sizes = f"SHAPE, SMALL = {shape!r}, {small!r}\n"
    if engine == "torch":
        body = "import torch\ntimes['import'] = time.perf_counter() - start\n" + TORCH
    else:
        body = (
            "import numpy as np\nimport cudnn_bn\n"
            "times['import'] = time.perf_counter() - start\n"
            f"def readme_block():\n    exec({README_BLOCK!r}, {{}})\n" + OURS
        )
    return PRELUDE + sizes + body + STAGES


def run_child(script: str, env: dict) -> dict:
    """Run ``script`` in a fresh interpreter: its stage times, wall time, CPU time, peak RSS."""
    begin = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", script], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - begin
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"child failed ({child.returncode}):\n{out}")
    stages = json.loads(out.strip().splitlines()[-1])
    stages.update(
        total_wall=wall, cpu=usage.ru_utime + usage.ru_stime, peak_rss_mb=usage.ru_maxrss / 1024
    )
    return stages


def measure(runs: int, quick: bool) -> dict[str, list[dict]]:
    """``runs`` rounds of torch, cudnn_bn cold and cudnn_bn warm, interleaved."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    results: dict[str, list[dict]] = {"torch": [], "cold": [], "warm": []}
    for _ in range(runs):
        results["torch"].append(run_child(child_script("torch", quick), env))
        with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
            ours = dict(env, NUMBA_CACHE_DIR=cache) if not quick else env
            for kind in ("cold", "warm"):
                results[kind].append(run_child(child_script("cudnn_bn", quick), ours))
    return results


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (Linux), or "unknown"."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def medians(samples: list[dict]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def markdown(results: dict[str, list[dict]], meta: dict) -> str:
    m = {kind: medians(results[kind]) for kind in ("cold", "warm", "torch")}
    lines = [f"# CPU engine cold start vs torch ({meta['date']})", ""]
    if meta["quick"]:
        lines += ["**QUICK DRY RUN: tiny shapes, a warm cache, not measurements.**", ""]
    lines += [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs; load average before / after: "
        f"{meta['load_before']} / {meta['load_after']}; torch {meta['torch']}, numba "
        f"{meta['numba']}; medians of {meta['runs']} interleaved runs.",
        "",
        "Fresh processes; cold: an empty numba cache; warm: the cache the cold run filled. "
        "Stage times in seconds, measured in the child; totals by the parent.",
        "",
        "| stage | cudnn_bn cold | cudnn_bn warm | torch |",
        "|---|---|---|---|",
    ]
    for key in m["cold"]:
        unit = " MB" if key == "peak_rss_mb" else ""
        cells = " | ".join(f"{m[kind].get(key, float('nan')):.2f}{unit}" for kind in m)
        lines.append(f"| {key} | {cells} |")
    first = {kind: m[kind]["import"] + m[kind]["readme_block"] for kind in m}
    lines += ["", "Import + README block (target: cold <= 3x torch, warm <= 1x):", ""]
    for kind in ("cold", "warm"):
        ratio = first[kind] / first["torch"]
        met = "yes" if ratio <= TARGETS[kind] else "**no**"
        lines.append(
            f"- {kind}: {first[kind]:.2f} s vs torch {first['torch']:.2f} s: {ratio:.1f}x "
            f"(target {TARGETS[kind]:.0f}x: {met})"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="dry mode: tiny shapes, 1 run")
    args = parser.parse_args(argv)
    if args.quick and args.out.resolve() == DEFAULT_OUT.resolve():
        parser.error("--quick writes no results into benchmarks/results: give --out")
    runs = 1 if args.quick else args.runs
    load_before = load_average()
    results = measure(runs, args.quick)
    load_after = load_average()
    import numba
    import torch

    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "quick": args.quick,
        "runs": runs,
        "command": " ".join(["python", *sys.argv]),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "torch": torch.__version__,
        "numba": numba.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cold-start-{meta['date']}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    report = markdown(results, meta)
    stem.with_suffix(".md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
