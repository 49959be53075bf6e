"""The evaluation suite file is data: it runs no command; tools/evaluate.py's --output folder holds
one run's results only."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import yaml

from mmssl.evaluation.suite import SuiteError, load_suite
from tests.evaluation.test_suite import REPO, _labelled, _tiny_clip


@pytest.mark.parametrize("key, spec", [
    ("test", "pipe:touch {ran}; cat {tar}"),
    ("train", "{tar}::pipe:touch {ran}"),
    ("classnames", "{{pipe:touch {ran},x}}"),
])
def test_a_pipe_source_in_a_suite_file_is_refused_naming_the_file_and_key(tmp_path, key, spec):
    ran = tmp_path / "ran"
    tar = tmp_path / "0.tar"
    tar.write_bytes(b"")
    entry = {"test": str(tmp_path), "train": str(tmp_path), "tasks": ["knn"]}  # loads whole but for the pipe:
    entry[key] = spec.format(ran=ran, tar=tar)
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"sets": {"a": entry}}))
    with pytest.raises(SuiteError, match=rf"{suite}: sets\.a\.{key}: .*pipe: source, which runs a shell command"):
        load_suite(str(suite))
    assert not ran.exists()


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny_clip_json) -> dict:
    root = tmp_path_factory.mktemp("scored")
    tests = {name: _labelled(root / name / "test", 8) for name in ("s", "t")}
    suites = {}
    for sets in (("s", "t"), ("s",)):
        body = "".join(f"  {n}:\n    test: {tests[n]}\n    tasks: [zero_shot]\n" for n in sets)
        suites[sets] = root / f"{'_'.join(sets)}.yaml"
        suites[sets].write_text(f"resamples: 10\nsets:\n{body}")
    main = runpy.run_path(str(REPO / "tools" / "evaluate.py"), run_name="not_main")["main"]
    return {"main": main, "ckpt": _tiny_clip(root, tiny_clip_json, 0), "model": tiny_clip_json, "suites": suites}


def _evaluate(scored: dict, sets: tuple, out: Path, *extra: str) -> int:
    return scored["main"](["--ckpt", scored["ckpt"], "--model", scored["model"], "--suite", str(scored["suites"][sets]),
                           "--output", str(out), "--batch-size", "8", "--num-workers", "0", *extra])


def test_evaluate_overwrite_leaves_one_runs_results_only(scored, tmp_path, capsys):
    out = tmp_path / "out"
    assert _evaluate(scored, ("s", "t"), out) == 0
    assert {p.name for p in out.glob("*_zero_shot_clip.json")} == {"s_zero_shot_clip.json", "t_zero_shot_clip.json"}
    assert _evaluate(scored, ("s",), out) == 1  # not empty, no --overwrite: refused, named
    assert f"--output {str(out)!r} is not empty" in capsys.readouterr().err
    assert _evaluate(scored, ("s",), out, "--overwrite") == 0
    assert {p.name for p in out.iterdir()} == {"s_zero_shot_clip.json", "results.csv", "results.md", "summary.json"}
    (out / "notes.txt").write_text("mine")  # --overwrite deletes only what the tool writes
    assert _evaluate(scored, ("s",), out, "--overwrite") == 1
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"


def test_a_run_whose_output_another_run_filled_meanwhile_fails_and_keeps_both(scored, tmp_path, monkeypatch, capsys):
    from mmssl.evaluation.runner import Runner

    out = tmp_path / "out"
    score = Runner.run

    def another_run_finishes_meanwhile(self, *args, **kwargs):
        out.mkdir(exist_ok=True)
        (out / "summary.json").write_text("the other run's")
        return score(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "run", another_run_finishes_meanwhile)
    assert _evaluate(scored, ("s",), out) == 1
    err = capsys.readouterr().err
    assert f"--output {str(out)!r} is not empty" in err and "filled while this run scored" in err
    assert (out / "summary.json").read_text() == "the other run's"
    kept = Path(err.split("this run's results are in ")[1].split("'")[1])
    assert (kept / "s_zero_shot_clip.json").is_file()
