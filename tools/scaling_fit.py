"""Fit L(C) = a * C^(-b) + c to the validation losses of several runs against their compute.

    python tools/scaling_fit.py runs/scaling/width*/version_0 --output scaling/ [--target-loss 2.0]

Each run folder holds ``metrics.csv`` and ``compute.json`` (FLOPs per optimizer step, written
by ``RunSummary`` at the run's first step); a run's compute is that times its steps. The final
(``--select best``: lowest) value of ``--metric`` of each run is one point; runs with the same
compute (seeds of one setting) are pooled into their mean, and their standard deviation weights
the fit. Prints the points and the fit with standard errors, and writes ``scaling_fit.png``
(log-log points and fitted curve), ``loss_vs_compute.png`` (every run's curve) and
``scaling_fit.json`` to ``--output``. ``--target-loss L`` prints the compute the fit predicts for L.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

import numpy as np

from mmssl.tools._common import run
from mmssl.visualize.figures import curves_figure, save_png, scaling_figure
from mmssl.visualize.scaling import fit_power_law, pool_points, read_run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (version_N, or a folder holding one)")
    p.add_argument("--metric", default="val/loss", help="metrics.csv column to fit (default val/loss)")
    p.add_argument("--select", choices=("final", "best"), default="final", help="each run's final or lowest value")
    p.add_argument("--target-loss", type=float, help="print the compute the fit predicts for this loss")
    p.add_argument("--output", required=True, help="folder for the PNGs and scaling_fit.json")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Fit, print and write the figures and ``scaling_fit.json``; the exit status."""
    args = parse_args(argv)
    return run("scaling_fit", lambda: _fit(args))


def _fit(args: argparse.Namespace) -> None:
    runs = [read_run(path, args.metric) for path in args.runs]
    compute, loss, spread, count = pool_points([run.pick(args.select) for run in runs])
    if len(compute) < 3:
        raise ValueError(f"{len(compute)} distinct compute budgets; a 3-parameter fit needs at least 3")
    fit = fit_power_law(compute, loss, spread if np.all(np.isfinite(spread)) else None)
    err = fit.stderr
    print(f"{'run(s)':>6} {'compute (FLOPs)':>16} {args.metric:>12} {'spread':>8}")
    for n, c, value, sd in zip(count, compute, loss, spread):
        print(f"{n:>6} {c:>16.4g} {value:>12.4f} {'' if math.isnan(sd) else f'{sd:.4f}':>8}")
    print(f"fit: {args.metric} = a * C^(-b) + c over {len(compute)} points")
    print(f"  b = {fit.b:.4f} +- {err['b']:.4f}")
    print(f"  c = {fit.c:.4f} +- {err['c']:.4f}")
    print(f"  a = {fit.a:.4g} (x/÷ {math.exp(err['log_a']):.3g})")
    at_bound = [name for name, hit in (("c = min(loss)", fit.c >= loss.min() * (1 - 1e-6)),
                                       ("b = 0", fit.b <= 1e-6), ("b = 5", fit.b >= 5 - 1e-6)) if hit]
    if at_bound:
        print(f"  warning: the fit sits on its bound ({', '.join(at_bound)}): these points do not constrain it")
    report = {
        "metric": args.metric,
        "select": args.select,
        "runs": [run.name for run in runs],
        "points": [
            {"compute": float(c), "value": float(v), "spread": None if math.isnan(s) else float(s), "runs": int(n)}
            for n, c, v, s in zip(count, compute, loss, spread)
        ],
        "a": fit.a,
        "b": fit.b,
        "c": fit.c,
        "stderr": err,
        "at_bound": at_bound,
        "covariance_log_a_b_c": fit.covariance.tolist(),
    }
    if args.target_loss is not None:
        report["target_loss"] = args.target_loss
        report["target_compute"] = fit.compute_for(args.target_loss)
        print(f"  {args.metric} = {args.target_loss} needs C = {report['target_compute']:.4g} FLOPs by the fit")
    os.makedirs(args.output, exist_ok=True)
    grid = np.logspace(
        np.log10(compute.min()) - 0.3, np.log10(max(compute.max(), report.get("target_compute", 0))) + 0.3, 200
    )
    label = f"{fit.a:.3g} C^-({fit.b:.3f}±{err['b']:.3f}) + {fit.c:.3f}"
    save_png(scaling_figure(compute, loss, None if np.isnan(spread).all() else np.nan_to_num(spread),
                            grid, fit(grid), label, fit.c, args.metric), os.path.join(args.output, "scaling_fit.png"))
    curves = [(os.path.relpath(run.name), run.compute, run.values) for run in runs]
    save_png(curves_figure(curves, args.metric), os.path.join(args.output, "loss_vs_compute.png"))
    with open(os.path.join(args.output, "scaling_fit.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.output}/scaling_fit.png, loss_vs_compute.png, scaling_fit.json")


if __name__ == "__main__":
    sys.exit(main())
