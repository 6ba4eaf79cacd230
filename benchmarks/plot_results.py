"""Render a ``bench_bn.py`` results JSON: the Markdown report, and the plot beside it.

``python benchmarks/plot_results.py RESULTS.json`` writes ``RESULTS.png`` (matplotlib: one
panel per pass, median GPU time per case, ours against PyTorch, grouped bars on a log scale);
``--markdown`` also rewrites ``RESULTS.md``. The bench calls both itself; matplotlib is
needed only for the plot and is not a dependency of the package.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

OURS_PREFIX = "ours_"
COLORS = {  # one colour per role in every panel
    "ours_api": "C0",
    "ours_compute": "C1",
    "ours_graph": "C2",
    "torch_cudnn": "C3",
    "torch_native": "C4",
    "torch_autograd": "C5",
    "torch_functional": "C5",
}
HOST_REFERENCES = ("torch_cudnn", "torch_native")


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


def _shape(row: dict) -> str:
    return "x".join(map(str, row["shape"]))


def _ratio(a: dict, b: dict) -> float | None:
    if a.get("status") == b.get("status") == "ok":
        return a["median_ms"] / b["median_ms"]
    return None


def _gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


def _rows(report: dict, pass_name: str) -> list[dict]:
    return [r for r in report["rows"] if r["pass"] == pass_name]


def _pass_section(report: dict, pass_name: str) -> list[str]:
    """One pass: times, ratios, bandwidth, correctness and, where captured, the graph."""
    spec, label, rows = report["passes"][pass_name], report["label"], _rows(report, pass_name)
    impls, checks = spec["impls"], spec["checks"]
    out = [f"## {spec['title']} [`{pass_name}`]", ""]
    out += [f"### GPU time per call, ms: median [p10, p90] ({label})", ""]
    out += _table(
        ["case", "shape", "dtype", "layout", "our engine", "D2D copy", *impls],
        [
            [
                r["name"],
                _shape(r),
                r["dtype"],
                r["layout"],
                str(r.get("engine")),
                _time(r["copy"]),
                *(_time(r["impls"][k]) for k in impls),
            ]
            for r in rows
        ],
    )
    ratio_keys = list(rows[0]["ratios"]) if rows else []
    out += [f"### Ours over PyTorch: ratio of median times, < 1 means ours is faster ({label})", ""]
    out += _table(
        ["case", *ratio_keys],
        [[r["name"], *(_num(r["ratios"][k]) for k in ratio_keys)] for r in rows],
    )
    out += [
        f"### Effective bandwidth: GB/s (fraction of the measured copy bandwidth) ({label})",
        "",
        f"Bytes moved: {spec['bytes_moved']}. Copy bandwidth: a device-to-device copy of "
        "x+dy+dx bytes, counted as read plus write.",
        "",
    ]
    out += _table(
        ["case", "bytes moved", "copy GB/s", *impls],
        [
            [
                r["name"],
                str(r["bytes_moved"]),
                _num(r["copy"].get("bandwidth_gbps"), ".3g"),
                *(_bandwidth(r["impls"][k]) for k in impls),
            ]
            for r in rows
        ],
    )
    shown = " / ".join(checks.values())
    out += [f"### Correctness: max abs difference from the PyTorch reference ({label})", ""]
    out += [f"Each cell: {shown} (n/a: not returned by that implementation).", ""]
    out += _table(
        ["case", "reference", "array API inputs", *impls],
        [
            [
                r["name"],
                str(r.get("reference")),
                str(r["impls"]["ours_api"].get("inputs", "n/a")),
                *(
                    " / ".join(
                        _num(r["impls"][k].get(f"{column}_max_abs_diff"), ".3g")
                        for column in checks
                    )
                    for k in impls
                ),
            ]
            for r in rows
        ],
    )
    if "ours_graph" in impls:
        out += [f"### CUDA graph: compute captured on a CuPy stream, replayed ({label})", ""]
        out += _table(
            ["case", "eager compute ms", "graph replay ms", "replay / eager", "replay vs eager"],
            [
                [
                    r["name"],
                    _time(r["impls"]["ours_compute"]),
                    _time(r["impls"]["ours_graph"]),
                    _num(_ratio(r["impls"]["ours_graph"], r["impls"]["ours_compute"])),
                    _num(r["impls"]["ours_graph"].get("replay_vs_eager_max_abs_diff"), ".3g"),
                ]
                for r in rows
            ],
        )
    return out


def _host_section(report: dict) -> list[str]:
    """Per pass: host µs per call, and each over PyTorch's cuDNN and native calls."""
    out = []
    for host in report["host_overhead"]:
        title = report["passes"][host["pass"]]["title"]
        out += [
            f"## Host overhead, {title}: {host['calls']} back-to-back calls on {host['case']}, "
            f"one synchronize ({report['label']})",
            "",
        ]
        impls = host["impls"]
        refs = [k for k in HOST_REFERENCES if k in impls]
        table = []
        for name, v in impls.items():
            us = v.get("us_per_call")
            row = [name, _num(us, ".2f") if "error" not in v else f"unavailable: {v['error']}"]
            for ref in refs:
                ref_us = impls[ref].get("us_per_call")
                row.append(_num(us / ref_us if us is not None and ref_us else None, ".2f"))
            table.append(row)
        out += _table(["implementation", "µs per call", *(f"/ {k}" for k in refs)], table)
    return out


def render_markdown(report: dict) -> str:
    """The whole report as Markdown: environment, method, and every figure of the JSON."""
    env, rows, passes = report["environment"], report["rows"], report["passes"]
    out = [f"# cudnn_bn batch-norm benchmark, {', '.join(passes)}: {env['device']}", ""]
    if report["dry_run"]:
        out += [f"**{report['label']}.** {report['dry_run_note']}", ""]
    out += ["## Environment", ""]
    out += _table(
        ["item", "value"], [[k, f"`{v}`" if k == "command" else str(v)] for k, v in env.items()]
    )
    out += ["## Method", "", *(f"- {line}" for line in report["method"]), ""]
    out += ["Implementations:", ""]
    for pass_name, spec in passes.items():
        out += [f"- {spec['title']} [`{pass_name}`]:"]
        out += [f"  - `{k}`: {v}" for k, v in spec["impls"].items()]
    out += [""]
    for pass_name in passes:
        out += _pass_section(report, pass_name)
    out += _host_section(report)
    missing = [
        [r["pass"], r["name"], k, e["error"]]
        for r in rows
        for k, e in [("copy", r["copy"]), *r["impls"].items()]
        if e.get("status") == "unavailable"
    ]
    out += ["## Unavailable", ""]
    out += _table(["pass", "case", "implementation", "error"], missing) if missing else ["none", ""]
    out += [
        "## Memory: the largest case's 20 GiB budget",
        "",
        *(f"- {line}" for line in report["largest_case_budget"]),
        "",
    ]
    peak = {(r["name"], r["pass"]): r.get("measured_peak_bytes") for r in rows}
    copy_peak = {r["name"]: r["copy"].get("measured_peak_bytes") for r in rows}
    out += [
        "Measured peak device memory, GiB (sampled before each free): the copy phase, "
        "then each pass:",
        "",
    ]
    out += _table(
        ["case", "D2D copy", *passes],
        [
            [n, _num(_gib(peak_bytes)), *(_num(_gib(peak.get((n, p)))) for p in passes)]
            for n, peak_bytes in copy_peak.items()
        ],
    )
    return "\n".join(out)


def plot(json_path: Path) -> Path:
    """One panel per pass: grouped bars of median GPU time per case, ours against PyTorch;
    ``.png`` beside the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(json_path).read_text())
    passes = report["passes"]
    names = list(dict.fromkeys(r["name"] for r in report["rows"]))
    fig, axes = plt.subplots(
        len(passes),
        1,
        figsize=(max(8.0, 1.5 * len(names) + 3), 4.5 * len(passes) + 1),
        squeeze=False,
    )
    for ax, (pass_name, spec) in zip(axes[:, 0], passes.items(), strict=True):
        rows = {r["name"]: r for r in _rows(report, pass_name)}
        impls = spec["impls"]
        width = 0.8 / max(1, len(impls))
        for i, (key, label) in enumerate(impls.items()):
            offsets = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(names))]
            values = [
                (rows[n]["impls"][key].get("median_ms") or math.nan) if n in rows else math.nan
                for n in names
            ]
            hatch = None if key.startswith(OURS_PREFIX) else "//"
            ax.bar(offsets, values, width, label=label, hatch=hatch, color=COLORS.get(key))
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
        ax.set_ylabel("median GPU ms per call (log)")
        ax.set_title(spec["title"])
        ax.legend(fontsize=7)
        if report["dry_run"]:
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
    title = f"batch norm, cudnn_bn vs PyTorch: {report['environment']['device']}"
    if report["dry_run"]:
        title = f"{report['label']}\n{title}"
    fig.suptitle(title)
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
