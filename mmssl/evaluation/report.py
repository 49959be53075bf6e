"""What a suite run writes: CLIP_benchmark's JSON per set and task, one CSV, one Markdown table,
the suite average of each task's main figure, and the paired comparison of two models.

A result file is what ``clip_benchmark eval`` dumps (``{"dataset", "model", "pretrained",
"task", "metrics": {...}, "language"}``), so CLIP_benchmark's own ``clip_benchmark build``
reads it into its CSV; the extra keys (``protocol``, ``ci95``, ``num_samples``, ``skipped``,
``settings``, ``bootstrap``) sit beside them. The suite average is DataComp's: the plain mean over
the sets of one figure per task (``MAIN_METRIC``), with an interval from the mean of each set's
bootstrap draws (the sets' draws are independent).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import stat
import tempfile
from typing import Any, Optional

import torch

from mmssl.checkpoints.io import fsync_folder
from mmssl.evaluation.bootstrap import PairedDifference, paired_difference, percentile_interval
from mmssl.evaluation.runner import CB_TASK, MAIN_METRIC, Result, set_seed


def result_name(result: Result) -> str:
    """The file stem of a result: ``SET_TASK_PROTOCOL``."""
    return f"{result.set}_{result.task}_{result.protocol}"


def _finite(x: float) -> Optional[float]:
    return None if x is None or math.isnan(x) else x


def result_json(result: Result, model: str, pretrained: str, resamples: int, seed: int) -> dict[str, Any]:
    """One result as CLIP_benchmark's JSON, with the protocol, intervals and counts beside it."""
    return {
        "dataset": result.set, "model": model, "pretrained": pretrained, "task": CB_TASK[result.task],
        "metrics": result.metrics(), "language": "en",
        "protocol": result.protocol,
        "ci95": {k: [_finite(lo), _finite(hi)] for k, (lo, hi) in result.intervals().items()},
        "num_samples": result.num_samples, "skipped": result.skipped, "seconds": result.seconds,
        "settings": result.settings,
        "bootstrap": {"resamples": resamples, "seed": set_seed(seed, result.set), "interval": "percentile, 95%"},
    }


def suite_average(results: list[Result]) -> list[dict[str, Any]]:
    """Per task and protocol: the mean of the main figure over the sets, with its 95% interval."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.task, r.protocol), []).append(r)
    rows = []
    for (task, protocol), group in groups.items():
        metric = MAIN_METRIC[task]
        value = sum(r.metrics()[metric] for r in group) / len(group)
        draws = torch.stack([r.draws[metric] for r in group]).mean(dim=0)  # (R,) sets' draws averaged
        low, high = percentile_interval(draws)
        rows.append({"task": task, "protocol": protocol, "metric": metric, "value": value, "ci95": [low, high],
                     "sets": [r.set for r in group]})
    return rows


def csv_text(results: list[Result]) -> str:
    """One row per set, task, protocol and figure."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["set", "task", "protocol", "metric", "value", "ci95_low", "ci95_high", "num_samples", "skipped"])
    for r in results:
        intervals = r.intervals()
        for name, value in r.metrics().items():
            writer.writerow([r.set, CB_TASK[r.task], r.protocol, name, f"{value:.6f}", f"{intervals[name][0]:.6f}",
                             f"{intervals[name][1]:.6f}", r.num_samples, r.skipped])
    return out.getvalue()


def _pct(value: float, interval: Optional[tuple[float, float]] = None) -> str:
    text = f"{100 * value:.2f}"
    return f"{text} [{100 * interval[0]:.2f}, {100 * interval[1]:.2f}]" if interval else text


def markdown_table(results: list[Result], averages: list[dict[str, Any]], title: str) -> str:
    """The main figure of every set, task and protocol (percent, 95% interval), then the suite averages."""
    lines = [f"### {title}", "", "| set | task | protocol | figure | value [95% CI] | samples | skipped |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        metric = MAIN_METRIC[r.task]
        lines.append(
            f"| {r.set} | {r.task} | {r.protocol} | {metric} | {_pct(r.metrics()[metric], r.intervals()[metric])} "
            f"| {r.num_samples} | {r.skipped} |"
        )
    lines += ["", "| suite average | protocol | figure | value [95% CI] | sets |", "|---|---|---|---|---|"]
    for a in averages:
        lines.append(
            f"| {a['task']} | {a['protocol']} | {a['metric']} | {_pct(a['value'], a['ci95'])} | {len(a['sets'])} |"
        )
    return "\n".join(lines) + "\n"


def write_report(results: list[Result], folder: str, model: str, pretrained: str, resamples: int,
                 seed: int, title: str) -> dict[str, Any]:
    """Write every result's JSON, ``results.csv``, ``results.md`` and ``summary.json`` into ``folder``.

    Returns:
        The summary (every result's JSON and the suite averages).
    """
    os.makedirs(folder, exist_ok=True)
    docs = []
    for r in results:
        doc = result_json(r, model, pretrained, resamples, seed)
        docs.append(doc)
        write_text(os.path.join(folder, f"{result_name(r)}.json"), json.dumps(doc, indent=2))
    averages = suite_average(results)
    write_text(os.path.join(folder, "results.csv"), csv_text(results))
    write_text(os.path.join(folder, "results.md"), markdown_table(results, averages, title))
    summary = {"model": model, "pretrained": pretrained, "results": docs, "suite_average": averages}
    write_text(os.path.join(folder, "summary.json"), json.dumps(summary, indent=2))
    return summary


def compare(a: list[Result], b: list[Result], resamples: int, seed: int) -> list[dict[str, Any]]:
    """The paired bootstrap of B - A for every set, task and protocol both have, on its main figure."""
    by_key = {(r.set, r.task, r.protocol): r for r in a}
    rows = []
    for rb in b:
        ra = by_key.get((rb.set, rb.task, rb.protocol))
        if ra is None:
            continue
        metric = MAIN_METRIC[rb.task]
        diff: PairedDifference = paired_difference(ra.figures[metric], ra.units, rb.figures[metric], rb.units,
                                                   resamples, set_seed(seed, rb.set))
        rows.append({"set": rb.set, "task": rb.task, "protocol": rb.protocol, "metric": metric, "a": diff.a,
                     "b": diff.b, "difference": diff.difference, "ci95": [diff.low, diff.high],
                     "p_value": diff.p_value, "num_samples": diff.num_units})
    return rows


def compare_markdown(rows: list[dict[str, Any]], a: str, b: str) -> str:
    """The comparison as a table: A, B, B - A with its interval, and the two-sided p."""
    lines = [
        f"### {b} against {a} (paired bootstrap, B - A)",
        "",
        "| set | task | protocol | figure | A | B | B - A [95% CI] | p | samples |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['set']} | {r['task']} | {r['protocol']} | {r['metric']} | {_pct(r['a'])} | {_pct(r['b'])} "
                     f"| {_pct(r['difference'], r['ci95'])} | {r['p_value']:.3f} | {r['num_samples']} |")
    return "\n".join(lines) + "\n"


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that ``path`` is at every moment its previous content or the
    new one, whole: a temporary file beside it, fsynced, then ``os.replace``-d over it. A kill or a
    full disk mid-write leaves the previous results, not an empty or half-written file. What every
    tool's ``--output-json`` and :func:`write_report` write through.

    Raises:
        OSError: the file could not be written, naming ``path``; no temporary file is left.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, _mode_for(path))  # mkstemp's 0o600 -> the replaced file's, or a plain open()'s
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_folder(folder)


def write_json(path: str, doc: Any) -> None:
    """``doc`` as indented JSON at ``path``, atomically (:func:`write_text`)."""
    write_text(path, json.dumps(doc, indent=2))


def _mode_for(path: str) -> int:
    """The permission bits a file written over ``path`` gets: the existing file's (a results file
    made group-readable stays so), else what a plain ``open()`` gives a new one."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:  # none yet (or not to be read): a new file's
        return 0o666 & ~_umask()


def _proc_umask() -> Optional[int]:
    """The process umask from ``/proc/self/status`` (Linux 4.7+), or ``None`` where it is not there."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _import_umask() -> int:
    mask = _proc_umask()
    if mask is None:  # no /proc: set and restore once, here at import, before any writer thread
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _import_umask()


def _umask() -> int:
    """The umask, read without changing it: ``os.umask(0)`` to read it would, for that moment, give
    files other threads create mode 0o666."""
    mask = _proc_umask()
    return _UMASK_AT_IMPORT if mask is None else mask
