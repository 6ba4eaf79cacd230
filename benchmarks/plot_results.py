"""Render a ``bench_bn.py`` results JSON: the Markdown report, and the plot beside it.

``python benchmarks/plot_results.py RESULTS.json`` writes ``RESULTS.png`` (matplotlib: median
GPU time per case, ours against PyTorch, grouped bars on a log scale); ``--markdown`` also
rewrites ``RESULTS.md``. The bench calls both itself; matplotlib is needed only for the plot
and is not a dependency of the package.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

OURS_PREFIX = "ours_"


def _num(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [
        "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |"
        for row in rows
    ]
    return [*lines, ""]


def _time(entry: dict) -> str:
    if entry.get("status") == "unavailable":
        return "unavailable"
    return f"{_num(entry['median_ms'], '.4f')} [{_num(entry['p10_ms'], '.4f')}, " + (
        f"{_num(entry['p90_ms'], '.4f')}]"
    )


def _bandwidth(entry: dict) -> str:
    if entry.get("status") == "unavailable":
        return "unavailable"
    return f"{_num(entry['bandwidth_gbps'], '.3g')} ({_num(entry['bandwidth_fraction'], '.2f')})"


def _shape(case: dict) -> str:
    return "x".join(map(str, case["shape"]))


def render_markdown(report: dict) -> str:
    """The whole report as Markdown: environment, method, and every figure of the JSON."""
    env, cases, impls = report["environment"], report["cases"], report["impls"]
    label = report["label"]
    out = [f"# cudnn_bn batch-norm backward benchmark: {env['device']}", ""]
    if report["dry_run"]:
        out += [f"**{label}.** {report['dry_run_note']}", ""]
    out += ["## Environment", ""]
    out += _table(
        ["item", "value"], [[k, f"`{v}`" if k == "command" else str(v)] for k, v in env.items()]
    )
    out += ["## Method", "", *(f"- {line}" for line in report["method"]), ""]
    out += ["Implementations:", "", *(f"- `{k}`: {v}" for k, v in impls.items()), ""]

    out += [f"## GPU time per call, ms: median [p10, p90] ({label})", ""]
    out += _table(
        ["case", "shape", "dtype", "layout", "our engine", "D2D copy", *impls],
        [
            [
                c["name"],
                _shape(c),
                c["dtype"],
                c["layout"],
                str(c.get("engine")),
                _time(c["copy"]),
                *(_time(c["impls"][k]) for k in impls),
            ]
            for c in cases
        ],
    )
    ratio_keys = list(cases[0]["ratios"]) if cases else []
    out += [f"## Ours over PyTorch: ratio of median times, < 1 means ours is faster ({label})", ""]
    out += _table(
        ["case", *ratio_keys],
        [[c["name"], *(_num(c["ratios"][k]) for k in ratio_keys)] for c in cases],
    )
    out += [
        f"## Effective bandwidth: GB/s (fraction of the measured copy bandwidth) ({label})",
        "",
        "Bytes moved: x and dy read, dx written. Copy bandwidth: a device-to-device copy "
        "of that many bytes, counted as read plus write.",
        "",
    ]
    out += _table(
        ["case", "bytes moved", "copy GB/s", *impls],
        [
            [
                c["name"],
                str(c["bytes_moved"]),
                _num(c["copy"].get("bandwidth_gbps"), ".3g"),
                *(_bandwidth(c["impls"][k]) for k in impls),
            ]
            for c in cases
        ],
    )
    out += [f"## Correctness: max abs difference from the PyTorch reference ({label})", ""]
    out += _table(
        ["case", "reference", "array API inputs", *(f"{k} dx / dw,db" for k in impls)],
        [
            [
                c["name"],
                str(c.get("reference")),
                str(c["impls"]["ours_api"].get("inputs", "n/a")),
                *(
                    f"{_num(c['impls'][k].get('dx_max_abs_diff'), '.3g')} / "
                    f"{_num(c['impls'][k].get('dwdb_max_abs_diff'), '.3g')}"
                    for k in impls
                ),
            ]
            for c in cases
        ],
    )
    out += [f"## CUDA graph: compute captured on a CuPy stream, replayed ({label})", ""]
    out += _table(
        ["case", "eager compute ms", "graph replay ms", "replay / eager", "replay vs eager diff"],
        [
            [
                c["name"],
                _time(c["impls"]["ours_compute"]),
                _time(c["impls"]["ours_graph"]),
                _num(_ratio(c["impls"]["ours_graph"], c["impls"]["ours_compute"])),
                _num(c["impls"]["ours_graph"].get("replay_vs_eager_max_abs_diff"), ".3g"),
            ]
            for c in cases
        ],
    )
    host = report["host_overhead"]
    out += [
        f"## Host overhead: {host['calls']} back-to-back calls on {host['case']}, "
        f"one synchronize ({label})",
        "",
    ]
    out += _table(
        ["implementation", "µs per call"],
        [
            [
                k,
                _num(v.get("us_per_call"), ".2f")
                if "error" not in v
                else f"unavailable: {v['error']}",
            ]
            for k, v in host["impls"].items()
        ],
    )
    missing = [
        [c["name"], k, e["error"]]
        for c in cases
        for k, e in [("copy", c["copy"]), *c["impls"].items()]
        if e.get("status") == "unavailable"
    ]
    out += ["## Unavailable", ""]
    out += _table(["case", "implementation", "error"], missing) if missing else ["none", ""]
    out += [
        "## Memory: the largest case's 20 GiB budget",
        "",
        *(f"- {line}" for line in report["largest_case_budget"]),
        "",
    ]
    out += _table(
        ["case", "measured peak device memory (GiB, sampled before each free)"],
        [[c["name"], _num(_gib(c.get("measured_peak_bytes")))] for c in cases],
    )
    return "\n".join(out)


def _ratio(a: dict, b: dict) -> float | None:
    if a.get("status") == b.get("status") == "ok":
        return a["median_ms"] / b["median_ms"]
    return None


def _gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


def plot(json_path: Path) -> Path:
    """Grouped bars of median GPU time per case, ours against PyTorch; ``.png`` beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(json_path).read_text())
    cases, impls = report["cases"], report["impls"]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(cases) + 3), 5.5))
    width = 0.8 / max(1, len(impls))
    for i, (key, label) in enumerate(impls.items()):
        offsets = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(cases))]
        values = [c["impls"][key].get("median_ms") or math.nan for c in cases]
        ax.bar(
            offsets, values, width, label=label, hatch=None if key.startswith(OURS_PREFIX) else "//"
        )
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), [c["name"] for c in cases], rotation=25, ha="right")
    ax.set_ylabel("median GPU time per call (ms, log scale)")
    title = f"batch-norm backward, cudnn_bn vs PyTorch: {report['environment']['device']}"
    if report["dry_run"]:
        title = f"{report['label']}\n{title}"
        ax.text(
            0.5,
            0.5,
            report["label"],
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=20,
            color="red",
            alpha=0.35,
            rotation=20,
        )
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(json_path).with_suffix(".png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results JSON written by bench_bn.py")
    parser.add_argument("--markdown", action="store_true", help="rewrite the .md beside it too")
    args = parser.parse_args(argv)
    if args.markdown:
        report = json.loads(args.results.read_text())
        args.results.with_suffix(".md").write_text(render_markdown(report) + "\n")
    print(plot(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
