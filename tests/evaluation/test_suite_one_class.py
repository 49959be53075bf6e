"""A suite's classification task on a set of one class is refused when the suite is read, naming
the entry: every prediction of it is right, and it scored 100 [100, 100] into the suite's averages.
Retrieval alone still scores such a set."""

from __future__ import annotations

import pytest

from mmssl.evaluation.suite import SuiteError, parse_suite
from tests.evaluation.test_suite import _labelled


@pytest.mark.parametrize("tasks", [["zero_shot"], ["retrieval", "knn"], ["linear_probe"]])
def test_a_classification_task_on_a_one_class_set_is_refused(tmp_path, tasks):
    test = _labelled(tmp_path / "one" / "test", 8, classes=1)
    train = _labelled(tmp_path / "one" / "train", 8, classes=1)
    with pytest.raises(SuiteError, match=rf"s.yaml: sets.a.tasks.{tasks[-1]}: the set has one class \('class 0'\), so "
                       "every prediction is right"):
        parse_suite({"sets": {"a": {"test": test, "train": train, "tasks": tasks}}}, "s.yaml")
    assert parse_suite({"sets": {"a": {"test": test, "tasks": ["retrieval"]}}}, "s.yaml").sets[0].name == "a"
