"""The benchmark suite's report: a markdown table per shape and a PNG plot of
time over floor against batch size, from the JSON files of ``suite.py run``.

    python benchmarks/suite.py report results/ --out results/
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional

DECODE_COLUMNS = ["eager", "hf_eager", "reduce_overhead", "piecewise", "whole_model", "whole_model_pieces"]
EXTEND_COLUMNS = ["eager", "reduce_overhead", "piecewise"]


def load(results: str) -> Dict[str, dict]:
    """``{shape: run}``, each run with its warm start merged in when present."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(results, "suite_*.json"))):
        run = json.load(open(path))
        warm = os.path.join(results, f"startup_{run['shape']}.json")
        if os.path.exists(warm):
            run["warm_startup"] = json.load(open(warm))["startup"]
        runs[run["shape"]] = run
    if not runs:
        raise SystemExit(f"{results}: expected suite_<shape>.json files from `suite.py run`, got none")
    return runs


def cell(ms: Optional[float], floor: Optional[float]) -> str:
    if ms is None:
        return "failed"
    return f"{ms:.2f} ({ms / floor:.1f}×)" if floor else f"{ms:.2f}"


def table(rows: Dict[str, dict], columns: List[str], label: str) -> List[str]:
    present = [c for c in columns if any(c in r for r in rows.values())]
    lines = [f"| {label} | floor ms | " + " | ".join(present) + " |", "|---" * (len(present) + 2) + "|"]
    for key, r in rows.items():
        floor = r.get("floor")
        cells = [cell(r.get(c), floor) if c in r else "—" for c in present]
        lines.append(f"| {key} | {floor:.3f} | " if floor else f"| {key} | — | ")
        lines[-1] += " | ".join(cells) + " |"
    return lines


def profile_lines(run: dict) -> List[str]:
    lines = ["| bs | whole_model kernels per layer | whole_model_pieces kernels per layer |", "|---|---|---|"]
    for bs, r in run["decode"].items():
        values = [r.get("whole_model_kernels_per_layer"), r.get("whole_model_pieces_kernels_per_layer")]
        lines.append(f"| {bs} | " + " | ".join("—" if v is None else f"{v:.1f}" for v in values) + " |")
    return lines


def time_lines(run: dict) -> List[str]:
    """Where a whole-model replay's time goes: each kernel class's own µs per
    layer (``suite_profile.replay_profile``) and the replay's span, per batch."""
    layers = run.get("config", {}).get("num_hidden_layers")
    profiles = {bs: r["whole_model_profile"] for bs, r in run["decode"].items()
                if "own_us_by_class" in r.get("whole_model_profile", {})}  # fmt: skip
    if not layers or not profiles:
        return []
    classes = sorted({kind for profile in profiles.values() for kind in profile["own_us_by_class"]})
    lines = ["| own µs per layer, whole-model replay | " + " | ".join(f"bs {bs}" for bs in profiles) + " |"]
    lines.append("|---" * (len(profiles) + 1) + "|")
    for kind in classes:
        cells = [f"{profile['own_us_by_class'].get(kind, 0.0) / layers:.1f}" for profile in profiles.values()]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| replay span, µs a step | " + " | ".join(f"{p['span_us']:.0f}" for p in profiles.values()) + " |")
    return lines


def startup_lines(run: dict) -> List[str]:
    cold, warm = run["startup"], run.get("warm_startup")
    lines = ["| capture | sizes | seconds | of which the first size | reserved memory added |", "|---|---|---|---|---|"]
    lines.append(f"| piecewise, 1st process | {cold['sizes']} | {cold['seconds']:.1f} | "
                 f"{cold['first_size_seconds']:.1f} | {cold['reserved_delta_gib']:.3f} GiB |")  # fmt: skip
    if warm:
        lines.append(f"| piecewise, 2nd process | {warm['sizes']} | {warm['seconds']:.1f} | "
                     f"{warm['first_size_seconds']:.1f} | {warm['reserved_delta_gib']:.3f} GiB |")  # fmt: skip
    for name, c in run.get("whole_model_capture", {}).items():
        lines.append(f"| {name} | {c['sizes']} | {c['seconds']:.1f} | — | {c['reserved_delta_gib']:.3f} GiB |")
    return lines


def markdown(runs: Dict[str, dict]) -> str:
    out = []
    for shape, run in runs.items():
        out += [f"### {shape}: {run['card']}, torch {run['torch']}, backend {run['backend']}, {run['date']}", ""]
        out += table(run["decode"], DECODE_COLUMNS, "decode bs") + [""]
        out += table(run["extend"], EXTEND_COLUMNS, "extend tokens") + [""]
        out += profile_lines(run) + [""] + time_lines(run) + [""] + startup_lines(run) + [""]
    return "\n".join(out)


Y_TICKS = (1, 1.5, 2, 3, 5, 10, 20, 50, 100)


def plot(runs: Dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (shape, run) in zip(axes[0], runs.items()):
        sizes = [int(bs) for bs in run["decode"]]
        for column in DECODE_COLUMNS:
            points = [(int(bs), r[column] / r["floor"]) for bs, r in run["decode"].items()
                      if r.get(column) is not None and r.get("floor")]  # fmt: skip
            if points:
                ax.plot(*zip(*points), marker="o", label=column)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        # Logarithmic: eager paths sit 10-60x above the floor, the graph
        # paths 1.5-5x, and on a linear axis the latter merge into one line.
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="floor")
        top = ax.get_ylim()[1]
        ax.set_yticks([t for t in Y_TICKS if t <= top], [f"{t:g}" for t in Y_TICKS if t <= top])
        ax.set_ylim(bottom=0.9)
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("step time / floor (log scale)")
        ax.set_title(f"{shape} ({run['card']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results: str, out: str) -> None:
    runs = load(results)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "suite.md"), "w") as f:
        f.write(markdown(runs))
    if all(any(r.get("floor") for r in run["decode"].values()) for run in runs.values()):
        plot(runs, os.path.join(out, "suite.png"))
    print(markdown(runs))
