"""The evaluation suite file (mmssl.evaluation.suite): what a good file parses to (defaults, protocols,
options, paths, class names and templates) and every refusal's exact message, naming the file and the
entry, so a bad suite stops before a model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmssl.evaluation.suite import Suite, SuiteError, TaskSpec, load_suite, parse_suite
from tests.data.shard_helpers import image_bytes
from tests.evaluation.test_suite import _labelled


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("suite_sets")
    out = {"test": _labelled(root / "s" / "test", 6), "train": _labelled(root / "s" / "train", 6),
           "unnamed": _labelled(root / "u" / "test", 4, classnames=False)}
    folder = root / "folder"
    for c in ("cat_a", "dog"):
        (folder / c).mkdir(parents=True)
        (folder / c / "0.jpg").write_bytes(image_bytes(1))
    out["folder"] = str(folder)
    (root / "one.txt").write_text("only\n")
    (root / "names.txt").write_text("n0\nn1\nn2\nn3\n")
    (root / "prompts.txt").write_text("a {c}.\n")
    (root / "bad_prompts.txt").write_text("no placeholder\n")
    out.update(root=str(root), names=str(root / "names.txt"), one=str(root / "one.txt"),
               prompts=str(root / "prompts.txt"), bad_prompts=str(root / "bad_prompts.txt"))
    return out


def _refused(data, message: str) -> None:
    with pytest.raises(SuiteError) as err:
        parse_suite(data, "s.yaml")
    assert str(err.value) == f"s.yaml: {message}"


def _set(spec) -> None:
    return {"sets": {"a": spec}}


def test_a_suite_of_task_names_takes_every_default(sets):
    suite = parse_suite({"sets": {"demo": {"test": sets["test"], "train": sets["train"],
                                           "tasks": ["zero_shot", "linear_probe", "knn", "retrieval"]}}})
    assert isinstance(suite, Suite) and (suite.path, suite.resamples, suite.seed) == ("<suite>", 1000, 0)
    (demo,) = suite.sets
    assert (demo.name, demo.test, demo.train, demo.limit_train, demo.limit_test) == (
        "demo", sets["test"], sets["train"], None, None)
    assert demo.tasks == [TaskSpec("zero_shot", ("clip",)), TaskSpec("linear_probe", ("clip", "mae")),
                          TaskSpec("knn", ("lightly", "dino")), TaskSpec("retrieval", ("clip",))]
    assert demo.classnames == [f"class {c}" for c in range(4)]
    assert demo.templates == ["a photo of a {c}.", "{c}"]
    assert demo.task("knn") is demo.tasks[2] and demo.task("zero_shot") is demo.tasks[0]


def test_a_suite_with_options_keeps_them(sets):
    suite = parse_suite({"resamples": 7, "seed": -3, "sets": {"a": {
        "test": sets["test"], "train": sets["train"], "limit_train": 1, "limit_test": 5,
        "classnames": sets["names"], "templates": sets["prompts"],
        "tasks": {"zero_shot": None, "knn": {"protocols": "dino"},
                  "linear_probe": {"protocols": ["clip_benchmark"], "val_fraction": 0.5, "val": sets["train"],
                                   "max_iter": 9, "mae": {"epochs": 2}, "clip_benchmark": {"lr": 0.1}},
                  "retrieval": {"recall_k": [2]}}}}}, "s.yaml")
    assert (suite.path, suite.resamples, suite.seed) == ("s.yaml", 7, -3)
    (a,) = suite.sets
    assert (a.limit_train, a.limit_test) == (1, 5)
    assert a.classnames == ["n0", "n1", "n2", "n3"] and a.templates == ["a {c}."]
    assert a.tasks == [TaskSpec("zero_shot", ("clip",)), TaskSpec("knn", ("dino",)),
                       TaskSpec("linear_probe", ("clip_benchmark",),
                                {"val_fraction": 0.5, "val": sets["train"], "max_iter": 9, "mae": {"epochs": 2},
                                 "clip_benchmark": {"lr": 0.1}}),
                       TaskSpec("retrieval", ("clip",), {"recall_k": [2]})]


def test_class_names_are_read_only_where_a_task_needs_them_and_missing_ones_stop_zero_shot_only(sets):
    retrieval = parse_suite(_set({"test": sets["test"], "tasks": ["retrieval"]})).sets[0]
    assert retrieval.classnames is None and retrieval.templates is None
    named = parse_suite(_set({"test": sets["test"], "classnames": sets["names"], "tasks": ["retrieval"]})).sets[0]
    assert named.classnames == ["n0", "n1", "n2", "n3"]
    probe = parse_suite(_set({"test": sets["unnamed"], "train": sets["unnamed"], "tasks": ["linear_probe"]})).sets[0]
    assert probe.classnames is None  # the probe counts the labels
    with pytest.raises(SuiteError, match=r"^s.yaml: sets.a.tasks.zero_shot: needs class names: .*classnames.txt"):
        parse_suite(_set({"test": sets["unnamed"], "tasks": ["retrieval", "zero_shot"]}), "s.yaml")
    _refused(_set({"test": sets["test"], "train": sets["test"], "classnames": sets["one"],
                   "tasks": ["retrieval", "knn"]}),
             "sets.a.tasks.knn: the set has one class ('only'), so every prediction is right; classification needs "
             "two classes or more (retrieval alone scores it)")
    with pytest.raises(SuiteError, match=r"^s.yaml: sets.a.templates: .*bad_prompts.txt"):
        parse_suite(_set({"test": sets["test"], "templates": sets["bad_prompts"], "tasks": ["zero_shot"]}), "s.yaml")
    with pytest.raises(SuiteError, match=r"^s.yaml: sets.a.templates: no such set '/nowhere.txt'$"):
        parse_suite(_set({"test": sets["test"], "templates": "/nowhere.txt", "tasks": ["zero_shot"]}), "s.yaml")


def test_each_bad_top_level_entry_is_named(sets):
    good = {"test": sets["test"], "tasks": ["retrieval"]}
    _refused(["sets"], "expected a mapping with 'sets', got list")
    _refused({"sets": {"a": good}, "resample": 3}, "suite: unknown key 'resample' (allowed: resamples, seed, sets)")
    for sets_value in (None, {}, ["a"]):
        _refused({"sets": sets_value}, "sets: expected a mapping of set name -> {test, train, tasks}")
    for bad in (0, -1, 2.5, "10"):
        _refused({"resamples": bad, "sets": {"a": good}}, f"resamples: expected a positive integer, got {bad!r}")
    assert parse_suite({"resamples": 1, "seed": 0, "sets": {"a": good}}).resamples == 1
    _refused({"seed": "1", "sets": {"a": good}}, "seed: expected an integer, got '1'")
    for name in ("", "x/y", 3):
        _refused({"sets": {name: good}}, f"sets: {name!r} is not a set name (a file-name part without '/')")


def test_each_bad_set_entry_is_named(sets):
    _refused(_set([1]), "sets.a: expected a mapping (test, train, tasks, ...), got [1]")
    _refused(_set({"test": sets["test"], "tasks": ["retrieval"], "val": 1}),
             "sets.a: unknown key 'val' (allowed: test, train, classnames, templates, limit_train, limit_test, tasks)")
    _refused(_set({"tasks": ["retrieval"]}), "sets.a: no 'test' set")
    _refused(_set({"test": sets["test"]}), "sets.a: no 'tasks'")
    for bad in (3, "", None):
        _refused(_set({"test": bad, "tasks": ["retrieval"]}), f"sets.a.test: expected a path, got {bad!r}")
    for gone in ("/gone", "/GoneX"):
        _refused(_set({"test": sets["root"] + gone, "tasks": ["retrieval"]}),
                 f"sets.a.test: no such set {sets['root'] + gone!r}")
    for key in ("limit_train", "limit_test"):
        for bad in (0, True, "5", 1.0):
            _refused(_set({"test": sets["test"], "tasks": ["retrieval"], key: bad}),
                     f"sets.a.{key}: expected a positive number of samples, got {bad!r}")
    for task in ("linear_probe", "knn"):
        _refused(_set({"test": sets["test"], "tasks": ["retrieval", task]}),
                 f"sets.a.tasks.{task}: needs a 'train' set to fit on")
    _refused(_set({"test": sets["folder"], "tasks": ["retrieval"]}),
             f"sets.a.tasks.retrieval: {sets['folder']!r} is an image folder, which has no captions")
    folder = parse_suite(_set({"test": sets["folder"], "tasks": ["zero_shot"]})).sets[0]
    assert folder.classnames == ["cat a", "dog"]


def test_a_set_path_is_resolved_and_a_shard_pattern_is_left_to_the_reader(sets, monkeypatch, tmp_path):
    pattern = sets["root"] + "/later/{0..3}.tar"
    assert parse_suite(_set({"test": pattern, "tasks": ["retrieval"]})).sets[0].test == pattern
    monkeypatch.setenv("HOME", str(Path(sets["test"]).parent))
    assert parse_suite(_set({"test": "~/test", "tasks": ["retrieval"]})).sets[0].test == sets["test"]
    # A clip_benchmark root stands for its test split.
    assert parse_suite(_set({"test": "~", "tasks": ["retrieval"]})).sets[0].test == sets["test"]
    root = tmp_path / "wds"
    (root / "train").mkdir(parents=True)
    (root / "train" / "nshards.txt").write_text("1")
    with pytest.raises(SuiteError) as err:
        parse_suite(_set({"test": str(root), "tasks": ["retrieval"]}), "s.yaml")
    assert str(err.value).startswith(f"s.yaml: sets.a.test: labelled set {str(root)!r} is a clip_benchmark wds/")
    for scheme in ("pipe:cat x.tar", "pipe:curl -s http://x/{0..1}.tar"):
        with pytest.raises(SuiteError, match=r"^s.yaml: sets.a.test: .*pipe: source, which runs a shell command"):
            parse_suite(_set({"test": scheme, "tasks": ["retrieval"]}), "s.yaml")


def test_each_bad_task_entry_is_named(sets):
    def task(tasks, message):
        _refused(_set({"test": sets["test"], "train": sets["train"], "tasks": tasks}), message)

    task("zero_shot", "sets.a.tasks: expected a list of tasks or a mapping task -> options, got 'zero_shot'")
    task([], "sets.a.tasks: no tasks")
    task({}, "sets.a.tasks: no tasks")
    task(["knn", "retrieval", "knn"], "sets.a.tasks: task 'knn' listed twice")
    task(["segmentation"], "sets.a.tasks: unknown task 'segmentation' (tasks: zero_shot, linear_probe, knn, retrieval)")
    task({"knn": [1]}, "sets.a.tasks.knn: expected a mapping of options, got [1]")
    task({"knn": {"k": 3}}, "sets.a.tasks.knn: unknown key 'k' (allowed: protocols)")
    task({"zero_shot": {"val": 1}}, "sets.a.tasks.zero_shot: unknown key 'val' (allowed: protocols)")
    task({"retrieval": {"max_iter": 1}},
         "sets.a.tasks.retrieval: unknown key 'max_iter' (allowed: protocols, recall_k)")
    task({"knn": {"protocols": ["dino", "faiss", "annoy"]}},
         "sets.a.tasks.knn.protocols: unknown protocol ['faiss'] (the knn protocols: lightly, dino)")
    task({"linear_probe": {"protocols": []}},
         "sets.a.tasks.linear_probe.protocols: unknown protocol () (the linear_probe protocols: clip, mae, "
         "clip_benchmark)")
    task({"zero_shot": {"protocols": "lightly"}},
         "sets.a.tasks.zero_shot.protocols: unknown protocol ['lightly'] (the zero_shot protocols: clip)")
    for bad in (0, 1, "0.5", 1.5):
        task({"linear_probe": {"val_fraction": bad}},
             f"sets.a.tasks.linear_probe.val_fraction: expected a fraction in (0, 1), got {bad!r}")
    for bad in ([], [0], [1, 2.0], "5", [True, 5][:0]):
        task({"retrieval": {"recall_k": bad}},
             f"sets.a.tasks.retrieval.recall_k: expected a list of positive integers, got {bad!r}")
    task({"linear_probe": {"clip_benchmark": 0.1}},
         "sets.a.tasks.linear_probe.clip_benchmark: expected a mapping of lr, epochs, batch_size, got 0.1")
    task({"linear_probe": {"clip_benchmark": {"epochs": 1, "wd": 0}}},
         "sets.a.tasks.linear_probe.clip_benchmark: unknown key 'wd' (allowed: lr, epochs, batch_size)")
    task({"linear_probe": {"val": sets["root"] + "/gone"}},
         f"sets.a.tasks.linear_probe.val: no such set {sets['root'] + '/gone'!r}")
    # val_fraction and recall_k belong to their tasks only; every protocol of a task is taken.
    tasks = parse_suite(_set({"test": sets["test"], "train": sets["train"], "tasks": {
        "linear_probe": {"protocols": ["clip", "mae", "clip_benchmark"], "val_fraction": 0.01},
        "retrieval": {"recall_k": [1, 100]}, "knn": {"protocols": ["lightly", "dino"]}}})).sets[0].tasks
    assert [t.protocols for t in tasks] == [("clip", "mae", "clip_benchmark"), ("clip",), ("lightly", "dino")]


def test_load_suite_reads_the_file_and_names_it_in_every_error(sets, tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_suite(str(tmp_path / "none.yaml"))
    assert str(err.value) == f"--suite: no file at {str(tmp_path / 'none.yaml')!r}"
    path = tmp_path / "s.yaml"
    path.write_text("sets: [\n  a")
    with pytest.raises(SuiteError) as err:
        load_suite(str(path))
    import yaml

    with pytest.raises(yaml.YAMLError) as yaml_err, open(path) as f:
        yaml.safe_load(f)
    assert str(err.value) == f"{path}: not YAML: " + " ".join(str(yaml_err.value).split())  # yaml's, on one line
    assert "\n" not in str(err.value) and "line 2" in str(err.value)
    path.write_text(f"seed: 4\nsets:\n  é:\n    test: {sets['test']}\n    tasks: [retrieval]\n", encoding="utf-8")
    suite = load_suite(str(path))
    assert (suite.path, suite.seed, suite.sets[0].name) == (str(path), 4, "é")
    path.write_text("sets:\n  a:\n    tasks: [retrieval]\n")
    with pytest.raises(SuiteError) as err:
        load_suite(str(path))
    assert str(err.value) == f"{path}: sets.a: no 'test' set"
