"""RankMe (label-free) beside zero-shot accuracy (labelled) over one run: a figure and a table.

    python benchmarks/health_curve.py --run runs/demo_clip/version_0 --output docs/health_curve.png

Reads the run's ``metrics.csv`` (``EmbeddingHealth`` and ``ZeroShot`` logged at each validation),
draws ``health/rankme`` and ``val/zero_shot_top1`` against the step on two axes (with the other
health figures below), prints a Markdown table of every validation and the Spearman rank
correlation of RankMe with zero-shot top-1 over the validations (no p-value: a run has a handful).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

KEYS = ("val/zero_shot_top1", "health/rankme", "health/rankme_text", "health/alignment", "health/uniformity",
        "health/modality_gap", "health/logit_scale")


def validations(run: Path) -> list[dict[str, float]]:
    """One row per validation step holding every key of ``KEYS`` that was logged there."""
    by_step: dict[int, dict[str, float]] = {}
    with open(run / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            values = {k: float(row[k]) for k in KEYS if row.get(k)}
            if values:
                by_step.setdefault(int(row["step"]), {"step": int(row["step"])}).update(values)
    return [r for _, r in sorted(by_step.items()) if "health/rankme" in r and "val/zero_shot_top1" in r]


def plot(rows: list[dict[str, float]], output: Path, title: str) -> None:
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[3, 2])
    top.plot(steps, [r["health/rankme"] for r in rows], "o-", color="tab:blue", label="RankMe (image)")
    if all("health/rankme_text" in r for r in rows):
        top.plot(steps, [r["health/rankme_text"] for r in rows], "o--", color="tab:cyan", label="RankMe (text)")
    top.set_ylabel("RankMe (no labels)")
    right = top.twinx()
    right.plot(steps, [100 * r["val/zero_shot_top1"] for r in rows], "s-", color="tab:red", label="zero-shot top-1")
    right.set_ylabel("zero-shot top-1 (%)")
    lines = top.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    top.legend(lines, [h.get_label() for h in lines], loc="lower right")
    top.set_title(title)
    for key, style in (("health/alignment", "o-"), ("health/uniformity", "s-"), ("health/modality_gap", "^-")):
        if all(key in r for r in rows):
            bottom.plot(steps, [r[key] for r in rows], style, label=key.split("/")[1])
    bottom.axhline(0, color="grey", lw=0.5)
    bottom.set_xlabel("step")
    bottom.legend(loc="best")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def table(rows: list[dict[str, float]]) -> str:
    head = (
        "| step | zero-shot top-1 | RankMe image | RankMe text | alignment | uniformity | modality gap | logit scale |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        cells = [f"{100 * r['val/zero_shot_top1']:.1f}%"] + [
            f"{r[k]:.2f}" if k in r else "" for k in KEYS[1:]]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run folder holding metrics.csv")
    parser.add_argument("--output", required=True, help="PNG to write")
    parser.add_argument("--title", default="demo CLIP: label-free RankMe beside zero-shot accuracy")
    args = parser.parse_args(argv)
    rows = validations(Path(args.run))
    if len(rows) < 2:
        print(f"{args.run}/metrics.csv: fewer than 2 validations with both health/rankme and val/zero_shot_top1",
              file=sys.stderr)
        return 1
    plot(rows, Path(args.output), args.title)
    print(table(rows))
    rho = spearmanr([r["health/rankme"] for r in rows], [r["val/zero_shot_top1"] for r in rows])
    print(f"\nSpearman rank correlation of RankMe (image) with zero-shot top-1 over {len(rows)} validations: "
          f"{rho.statistic:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
