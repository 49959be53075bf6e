"""Loss against training compute: read runs, fit L(C) = a * C^(-b) + c, predict compute.

The saturating power law of Kaplan et al. (2020, eq. 1.4 form with an irreducible term, as in
Hoffmann et al. 2022, eq. 2). Each run's compute is its FLOPs per optimizer step, counted at the
run's start and written to ``compute.json`` by ``mmssl.callbacks.RunSummary``, times the steps
taken (``step + 1`` of ``metrics.csv``); its losses are read from the run's ``metrics.csv``, so no model is needed.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import numpy as np
from scipy.optimize import curve_fit

from mmssl.flops import COMPUTE_FILE


@dataclass
class RunCurve:
    """One run's metric against its compute.

    Attributes:
        name: the run folder.
        flops_per_step: training FLOPs of one optimizer step (all devices).
        steps: (K,) the ``step`` column at each logged value (0-based index of the last step).
        values: (K,) the metric there.
    """

    name: str
    flops_per_step: float
    steps: np.ndarray
    values: np.ndarray

    @property
    def compute(self) -> np.ndarray:
        """(K,) training FLOPs at each logged value.

        ``metrics.csv``'s ``step`` is Lightning's 0-based index of the last optimizer step taken
        (the validation after 78 steps logs step 77), so ``step + 1`` steps have run.
        """
        return self.flops_per_step * (self.steps + 1)

    def pick(self, which: Literal["final", "best"]) -> tuple[float, float]:
        """(compute, value) of the last logged value, or of the lowest."""
        i = len(self.values) - 1 if which == "final" else int(np.argmin(self.values))
        return float(self.compute[i]), float(self.values[i])


def read_run(run_dir: str, metric: str = "val/loss") -> RunCurve:
    """Read ``compute.json`` and the ``metric`` column of ``metrics.csv`` of a run folder.

    Args:
        run_dir: a run folder (``runs/.../version_N``), or a folder holding one ``version_N``.
        metric: the ``metrics.csv`` column.

    Returns:
        The run's curve (rows without the metric skipped; a resumed run's repeated steps keep
        the last value).
    """
    if not os.path.isfile(os.path.join(run_dir, "metrics.csv")):
        versions = sorted(d for d in os.listdir(run_dir) if d.startswith("version_")) if os.path.isdir(run_dir) else []
        if len(versions) != 1:
            raise FileNotFoundError(f"{run_dir}: no metrics.csv (and not exactly one version_N folder inside)")
        run_dir = os.path.join(run_dir, versions[0])
    compute_path = os.path.join(run_dir, COMPUTE_FILE)
    if not os.path.isfile(compute_path):
        raise FileNotFoundError(f"{compute_path}: missing; runs record their FLOPs per step there at their first "
                                "step (RunSummary, summary.count_flops=true)")
    with open(compute_path) as f:
        flops = json.load(f).get("flops_per_step")
    if not isinstance(flops, (int, float)) or flops <= 0:
        raise ValueError(f"{compute_path}: 'flops_per_step' must be a positive number, got {flops!r}")
    by_step: dict[int, float] = {}
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        reader = csv.DictReader(f)
        if metric not in (reader.fieldnames or []):
            raise KeyError(f"{run_dir}/metrics.csv has no {metric!r} column (columns: {reader.fieldnames})")
        for row in reader:
            if row.get(metric) not in ("", None):
                by_step[int(row["step"])] = float(row[metric])
    if not by_step:
        raise ValueError(f"{run_dir}/metrics.csv logs no {metric!r} value")
    steps = np.array(sorted(by_step), dtype=np.float64)
    return RunCurve(run_dir, float(flops), steps, np.array([by_step[int(s)] for s in steps]))


def pool_points(
    points: Sequence[tuple[float, float]], rel_tol: float = 1e-6
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pool runs of the same compute (seeds of one setting) into a mean and its spread.

    Returns:
        ``(compute, mean, std, count)``, each (P,), sorted by compute; ``std`` is the sample
        standard deviation of the pooled losses (NaN for a single run).
    """
    groups: list[list[tuple[float, float]]] = []
    for c, value in sorted(points):
        if groups and math.isclose(groups[-1][0][0], c, rel_tol=rel_tol):
            groups[-1].append((c, value))
        else:
            groups.append([(c, value)])
    compute = np.array([g[0][0] for g in groups])
    values = [np.array([v for _, v in g]) for g in groups]
    mean = np.array([v.mean() for v in values])
    std = np.array([v.std(ddof=1) if len(v) > 1 else np.nan for v in values])
    return compute, mean, std, np.array([len(v) for v in values])


def power_law(compute: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
    """L(C) = a * C^(-b) + c."""
    return a * np.power(compute, -b) + c


@dataclass
class PowerLawFit:
    """The fitted L(C) = a * C^(-b) + c, C in FLOPs, and the parameters' standard errors.

    ``covariance`` is that of (log a, b, c): a spans many decades, so it is fitted in logs.
    """

    a: float
    b: float
    c: float
    covariance: np.ndarray

    @property
    def stderr(self) -> dict[str, float]:
        """Standard errors of b and c, and the relative (log) error of a."""
        sd = np.sqrt(np.clip(np.diag(self.covariance), 0, None))
        return {"log_a": float(sd[0]), "b": float(sd[1]), "c": float(sd[2])}

    def __call__(self, compute: np.ndarray) -> np.ndarray:
        return power_law(np.asarray(compute, dtype=np.float64), self.a, self.b, self.c)

    def compute_for(self, loss: float) -> float:
        """The compute at which the fit reaches ``loss``: C = (a / (loss - c))^(1/b)."""
        if loss <= self.c:
            raise ValueError(f"target loss {loss} is at or below the fitted irreducible loss c = {self.c:.4g}: "
                             "no compute reaches it")
        return float((self.a / (loss - self.c)) ** (1.0 / self.b))


def fit_power_law(compute: np.ndarray, loss: np.ndarray, sigma: Optional[np.ndarray] = None) -> PowerLawFit:
    """Least-squares fit of L(C) = a * C^(-b) + c (``scipy.optimize.curve_fit``).

    C is scaled by its geometric mean C0 during the fit (L = a0 (C/C0)^(-b) + c, a = a0 C0^b), so
    the parameters are of order one. Bounds: a > 0, b in (0, 5), 0 <= c < min(L).

    Args:
        compute: (N,) FLOPs, N >= 3.
        loss: (N,) losses.
        sigma: (N,) standard deviations of the losses: the points are weighted by 1/sigma^2 and
            the errors are absolute; ``None`` (or any NaN): equal weights, errors scaled by the
            residuals.

    Returns:
        The fit with its covariance.
    """
    compute, loss = np.asarray(compute, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if compute.shape != loss.shape or compute.ndim != 1 or len(compute) < 3:
        raise ValueError(f"the fit needs at least 3 (compute, loss) points, got {len(compute)}")
    if (compute <= 0).any():
        raise ValueError("compute must be positive")
    weighted = sigma is not None and np.all(np.isfinite(sigma)) and np.all(np.asarray(sigma) > 0)
    c0 = float(np.exp(np.log(compute).mean()))
    x = compute / c0

    def model(x, log_a0, b, c):
        return np.exp(log_a0) * np.power(x, -b) + c

    # Start: c a little under the lowest loss, then a line in log(L - c) against log C.
    c_start = 0.5 * float(loss.min())
    slope, intercept = np.polyfit(np.log(x), np.log(np.clip(loss - c_start, 1e-12, None)), 1)
    p0 = (intercept, float(np.clip(-slope, 1e-3, 4.9)), c_start)
    lower, upper = (-np.inf, 0.0, 0.0), (np.inf, 5.0, float(loss.min()))
    params, cov = curve_fit(model, x, loss, p0=p0, sigma=sigma if weighted else None,
                            absolute_sigma=bool(weighted), bounds=(lower, upper), maxfev=20000)
    log_a0, b, c = (float(p) for p in params)
    # log a = log a0 + b log C0: propagate the covariance through that linear map.
    jacobian = np.array([[1.0, math.log(c0), 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    return PowerLawFit(math.exp(log_a0 + b * math.log(c0)), b, c, jacobian @ cov @ jacobian.T)
