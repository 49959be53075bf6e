"""What the suite's report files hold, field by field (mmssl.evaluation.report): the result JSON that
CLIP_benchmark's ``clip_benchmark build`` reads (its keys and task names), an undefined interval
written as null (valid JSON), every figure's CSV row, the Markdown tables of a run and of a comparison,
and the suite average per task and protocol."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch

from mmssl.evaluation.bootstrap import Ratio, draw_counts, percentile_interval
from mmssl.evaluation.report import (
    compare,
    compare_markdown,
    csv_text,
    markdown_table,
    result_json,
    result_name,
    suite_average,
    write_report,
)
from mmssl.evaluation.runner import Result, set_seed


def _ratio(right: list[int]) -> Ratio:
    return Ratio(torch.tensor(right, dtype=torch.float32), torch.ones(len(right)))


def _result(name: str, task: str, protocol: str, figures: dict[str, Ratio], resamples: int = 50,
            seed: int = 0, **extra) -> Result:
    num_units = next(iter(figures.values())).num_units()
    weights = draw_counts(num_units, resamples, set_seed(seed, name))
    return Result(name, task, protocol, figures, torch.arange(num_units),
                  {k: f.values(weights).float() for k, f in figures.items()}, **extra)


ZS = {"acc1": _ratio([1, 0, 1, 1]), "acc5": _ratio([1, 1, 1, 1]), "mean_per_class_recall": _ratio([1, 0, 0, 1])}


def test_a_result_is_clip_benchmarks_json_with_the_protocol_intervals_and_counts_beside_it():
    r = _result("cars", "zero_shot", "clip", ZS, num_samples=4, skipped=1, seconds=2.5, settings={"num_templates": 3})
    doc = result_json(r, "ViT-B-16", "run/last.ckpt", 50, seed=7)
    assert result_name(r) == "cars_zero_shot_clip"
    assert {k: doc[k] for k in ("dataset", "model", "pretrained", "task", "language")} == {
        "dataset": "cars", "model": "ViT-B-16", "pretrained": "run/last.ckpt", "task": "zeroshot_classification",
        "language": "en"}
    assert doc["metrics"] == {"acc1": 0.75, "acc5": 1.0, "mean_per_class_recall": 0.5}
    assert doc["ci95"] == {k: list(percentile_interval(d)) for k, d in r.draws.items()}
    assert (doc["protocol"], doc["num_samples"], doc["skipped"], doc["seconds"], doc["settings"]) == (
        "clip", 4, 1, 2.5, {"num_templates": 3})
    assert doc["bootstrap"] == {"resamples": 50, "seed": set_seed(7, "cars"), "interval": "percentile, 95%"}
    tasks = {t: result_json(_result("s", t, "p", {"acc1": _ratio([1])}), "m", "p", 1, 0)["task"]
             for t in ("linear_probe", "knn", "retrieval")}
    assert tasks == {"linear_probe": "linear_probe", "knn": "knn", "retrieval": "zeroshot_retrieval"}


def test_an_interval_without_draws_is_written_as_null_never_nan():
    r = _result("empty", "zero_shot", "clip", {"acc1": _ratio([1, 0])})
    r.draws["acc1"] = torch.zeros(0)  # no draw: the interval is undefined
    text = json.dumps(result_json(r, "m", "p", 0, 0), allow_nan=False)  # raises on a NaN
    assert json.loads(text)["ci95"]["acc1"] == [None, None]


def test_the_csv_has_a_row_per_figure_with_its_interval_and_counts():
    r = _result("cars", "zero_shot", "clip", ZS, num_samples=4, skipped=1)
    rows = list(csv.reader(io.StringIO(csv_text([r]))))
    assert rows[0] == ["set", "task", "protocol", "metric", "value", "ci95_low", "ci95_high", "num_samples", "skipped"]
    want = []
    for name, figure in ZS.items():
        low, high = percentile_interval(r.draws[name])
        want.append(["cars", "zeroshot_classification", "clip", name, f"{figure.point():.6f}", f"{low:.6f}",
                     f"{high:.6f}", "4", "1"])
    assert rows[1:] == want


def test_the_markdown_table_shows_each_main_figure_and_the_suite_average():
    a = _result("cars", "zero_shot", "clip", ZS, num_samples=4, skipped=1)
    b = _result("pets", "linear_probe", "mae", {"lp_acc1": _ratio([1, 1, 0, 0, 0])}, num_samples=5)
    averages = suite_average([a, b])
    table = markdown_table([a, b], averages, "My run")
    low, high = a.intervals()["acc1"]
    plow, phigh = b.intervals()["lp_acc1"]
    assert table == (
        "### My run\n\n| set | task | protocol | figure | value [95% CI] | samples | skipped |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| cars | zero_shot | clip | acc1 | 75.00 [{100 * low:.2f}, {100 * high:.2f}] | 4 | 1 |\n"
        f"| pets | linear_probe | mae | lp_acc1 | 40.00 [{100 * plow:.2f}, {100 * phigh:.2f}] | 5 | 0 |\n"
        "\n| suite average | protocol | figure | value [95% CI] | sets |\n|---|---|---|---|---|\n"
        f"| zero_shot | clip | acc1 | 75.00 [{100 * low:.2f}, {100 * high:.2f}] | 1 |\n"
        f"| linear_probe | mae | lp_acc1 | 40.00 [{100 * plow:.2f}, {100 * phigh:.2f}] | 1 |\n")


def test_the_suite_average_is_per_task_and_protocol_over_its_sets():
    sets = [_result(f"s{i}", "zero_shot", "clip", {"acc1": _ratio(right)}, seed=0)
            for i, right in enumerate([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])]
    other = _result("s0", "zero_shot", "openai", {"acc1": _ratio([1, 1, 1, 1])})
    rows = suite_average([*sets, other])
    assert [(r["task"], r["protocol"], r["metric"], r["sets"]) for r in rows] == [
        ("zero_shot", "clip", "acc1", ["s0", "s1", "s2"]), ("zero_shot", "openai", "acc1", ["s0"])]
    assert rows[0]["value"] == pytest.approx(0.5)
    mean_draws = torch.stack([r.draws["acc1"] for r in sets]).mean(dim=0)
    assert rows[0]["ci95"] == pytest.approx(list(percentile_interval(mean_draws)))
    assert rows[1]["value"] == 1.0


def test_compare_pairs_the_shared_sets_and_its_table_shows_b_minus_a(tmp_path):
    a = [_result("cars", "zero_shot", "clip", {"acc1": _ratio([1, 0, 0, 1, 0, 1, 0, 0])}),
         _result("pets", "zero_shot", "clip", {"acc1": _ratio([1, 1])})]  # B has no pets: left out
    b = [_result("cars", "zero_shot", "openai", {"acc1": _ratio([1] * 8)}),  # A has no openai protocol
         _result("cars", "zero_shot", "clip", {"acc1": _ratio([1, 1, 1, 1, 0, 1, 1, 0])})]
    [row] = compare(a, b, 200, seed=3)
    assert (row["set"], row["task"], row["protocol"], row["metric"], row["num_samples"]) == (
        "cars", "zero_shot", "clip", "acc1", 8)
    assert (row["a"], row["b"], row["difference"]) == pytest.approx((0.375, 0.75, 0.375))
    table = compare_markdown([row], "base.ckpt", "new.ckpt")
    low, high = row["ci95"]
    assert table == (
        "### new.ckpt against base.ckpt (paired bootstrap, B - A)\n\n"
        "| set | task | protocol | figure | A | B | B - A [95% CI] | p | samples |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        f"| cars | zero_shot | clip | acc1 | 37.50 | 75.00 | 37.50 [{100 * low:.2f}, {100 * high:.2f}] "
        f"| {row['p_value']:.3f} | 8 |\n")
    assert low > 0 and not math.isnan(row["p_value"])


def test_write_report_writes_every_file_and_returns_the_summary(tmp_path):
    r = _result("cars", "zero_shot", "clip", ZS, num_samples=4)
    summary = write_report([r], str(tmp_path / "out"), "m", "p.ckpt", 50, 0, "Title")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "cars_zero_shot_clip.json", "results.csv", "results.md", "summary.json"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (summary["model"], summary["pretrained"]) == ("m", "p.ckpt")
    assert summary["results"] == [json.loads(json.dumps(result_json(r, "m", "p.ckpt", 50, 0)))]
    assert (tmp_path / "out" / "results.csv").read_bytes().decode() == csv_text([r])
    assert (tmp_path / "out" / "results.md").read_text() == markdown_table([r], suite_average([r]), "Title")
