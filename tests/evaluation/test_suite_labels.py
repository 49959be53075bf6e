"""A suite set whose class list misses some of its labels is refused naming the set, the split and
a sample, before any figure is scored (its figures would all be wrong, silently)."""

from __future__ import annotations

from pathlib import Path

from tests.evaluation.test_suite import _labelled, _tiny_clip
from tests.evaluation.test_suite_output import REPO


def test_labels_outside_the_class_names_are_refused_naming_the_set(tmp_path, tiny_clip_json, capsys):
    import runpy

    test = _labelled(tmp_path / "s" / "test", 8, classes=4)
    (Path(test).parent / "classnames.txt").write_text("class 0\nclass 1\n")  # labels 2 and 3 have no name
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"resamples: 10\nsets:\n  s:\n    test: {test}\n    tasks: [zero_shot, knn]\n    train: {test}\n")
    main = runpy.run_path(str(REPO / "tools" / "evaluate.py"), run_name="not_main")["main"]
    code = main(["--ckpt", _tiny_clip(tmp_path, tiny_clip_json, 0), "--model", tiny_clip_json, "--suite", str(suite),
                 "--output", str(tmp_path / "out"), "--batch-size", "8", "--num-workers", "0"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"suite set 's': labelled set {test!r} has 4 labels outside [0, 2)" in err and "e.g. label" in err
    assert not (tmp_path / "out" / "summary.json").exists()
