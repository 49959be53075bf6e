"""The evaluation suite file: labelled sets, each with its tasks, checked before any model runs.

A suite is YAML (``tools/evaluate.py --suite FILE``)::

    resamples: 1000            # bootstrap draws per figure (default 1000)
    seed: 0                    # seeds the draws, the probes' held-out split and MAE probe's init
    sets:
      demo:                                   # the set's name, used in file names and tables
        test: ~/data/demo/val                 # the scored split (any labelled-set layout); ~ and
        train: ~/data/demo/train              # ${VAR-default} expanded; linear_probe and knn fit on it
        limit_train: 5000                     # optional: the first N samples (shard order)
        tasks: [zero_shot, linear_probe, knn, retrieval]

Tasks are a list of names (default options) or a mapping ``task: {options}``:

- ``zero_shot``: the set's ``classnames`` / ``templates`` (files beside the set, or given here).
- ``linear_probe``: ``protocols: [clip, mae]`` (the default; also ``clip_benchmark``: CLIP_benchmark's
  AdamW probe, options ``clip_benchmark: {lr, epochs, batch_size}``); ``val_fraction`` (0.2: the held-out part of the
  training split for the regularisation search) or ``val`` (a split of its own); ``mae`` (the
  ``fit_mae_linear`` arguments: ``epochs``, ``optimizer``, ``blr``, ...).
- ``knn``: ``protocols: [lightly, dino]``.
- ``retrieval``: ``recall_k: [1, 5, 10]`` (each test image's ``txt`` lines are its captions).

A suite is data, not code: a ``pipe:`` source (webdataset runs its command in a shell) is refused
in every path. Every problem (an unknown key, task or protocol, a missing set, a zero-shot set
without class names, a classification task on a set of one class, a probe without a training
split, a ``pipe:``) raises :class:`SuiteError` naming the entry (``sets.demo.tasks.zero_shot``), so
a bad suite stops before a model is loaded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from mmssl.data.label_files import is_image_folder, read_classnames, read_templates, resolve_labeled
from mmssl.data.sources import refuse_pipe

# The protocols of each task; the JSON names the one used.
PROTOCOLS: dict[str, tuple[str, ...]] = {
    "zero_shot": ("clip",),  # CLIP sec. 3.1.4: prompt ensembles of the set's templates
    # CLIP appendix A.3 (L-BFGS + lambda search); MAE appendix A.1; CLIP_benchmark 1.6.2's AdamW probe
    "linear_probe": ("clip", "mae", "clip_benchmark"),
    "knn": ("lightly", "dino"),  # lightly's knn_predict (k=200, T=0.1); DINO's eval_knn (k=20, T=0.07)
    "retrieval": ("clip",),  # CLIP_benchmark's zeroshot_retrieval recall@k
}
# Run when a task names no protocols: all but clip_benchmark's probe, a peer's recipe for
# comparing with its figures (an under-trained fit on near-separable features).
DEFAULT_PROTOCOLS: dict[str, tuple[str, ...]] = {**PROTOCOLS, "linear_probe": ("clip", "mae")}
TASK_OPTIONS: dict[str, tuple[str, ...]] = {
    "zero_shot": ("protocols",),
    "linear_probe": ("protocols", "val_fraction", "val", "max_iter", "mae", "clip_benchmark"),
    "knn": ("protocols",),
    "retrieval": ("protocols", "recall_k"),
}
SET_KEYS = ("test", "train", "classnames", "templates", "limit_train", "limit_test", "tasks")
SUITE_KEYS = ("resamples", "seed", "sets")
NEEDS_TRAIN = ("linear_probe", "knn")


class SuiteError(ValueError):
    """A suite file problem, naming the file and the entry."""


@dataclass
class TaskSpec:
    """One task of a set: its name, protocols and options."""

    name: str
    protocols: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class SetSpec:
    """One labelled set of the suite (paths resolved, class names and templates read)."""

    name: str
    test: str
    train: Optional[str]
    tasks: list[TaskSpec]
    classnames: Optional[list[str]] = None
    templates: Optional[list[str]] = None
    limit_train: Optional[int] = None
    limit_test: Optional[int] = None

    def task(self, name: str) -> Optional[TaskSpec]:
        return next((t for t in self.tasks if t.name == name), None)


@dataclass
class Suite:
    """The parsed suite file."""

    path: str
    sets: list[SetSpec]
    resamples: int = 1000
    seed: int = 0


def _unknown(keys: Any, allowed: tuple[str, ...], where: str) -> None:
    extra = [k for k in keys if k not in allowed]
    if extra:
        raise SuiteError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(allowed)})")


# ``${VAR}``, ``${VAR-default}`` (the default where VAR is unset) and ``${VAR:-default}`` (also where empty).
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*))?\}")


def expand_path(value: str, where: str = "path") -> str:
    """A suite path with its environment variables and ``~`` expanded, shell-style: the demo's
    sets are ``${XDG_CACHE_HOME-~/.cache}/mmssl/demo/val``, where ``mmssl.data.demo`` writes them.

    Raises:
        SuiteError: a ``${VAR}`` without a default whose variable is unset, naming it.
    """
    def variable(match: re.Match) -> str:
        name, kind, default = match[1], match[2], match[3]
        found = os.environ.get(name)
        if kind == ":-" and not found or kind == "-" and found is None:
            return default
        if found is None:
            raise SuiteError(f"{where}: {value!r} names the environment variable {name}, which is not set "
                             f"(or write ${{{name}-default}})")
        return found

    return os.path.expanduser(_VARIABLE.sub(variable, value))


def _path(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise SuiteError(f"{where}: expected a path, got {value!r}")
    try:
        refuse_pipe(value, where)
    except ValueError as err:
        raise SuiteError(str(err)) from None
    path = expand_path(value, where)
    if not os.path.exists(path) and not any(c in path for c in "{:"):  # a shard pattern is checked on reading
        raise SuiteError(f"{where}: no such set {value!r}")
    try:
        return resolve_labeled(path)
    except OSError as err:
        raise SuiteError(f"{where}: {err}") from None


def _limit(value: Any, where: str) -> Optional[int]:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise SuiteError(f"{where}: expected a positive number of samples, got {value!r}")
    return value


def _task(name: Any, options: Any, where: str) -> TaskSpec:
    if name not in PROTOCOLS:
        raise SuiteError(f"{where}: unknown task {name!r} (tasks: {', '.join(PROTOCOLS)})")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise SuiteError(f"{where}.{name}: expected a mapping of options, got {options!r}")
    _unknown(options, TASK_OPTIONS[name], f"{where}.{name}")
    protocols = options.pop("protocols", DEFAULT_PROTOCOLS[name])
    protocols = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    bad = [p for p in protocols if p not in PROTOCOLS[name]]
    if bad or not protocols:
        raise SuiteError(f"{where}.{name}.protocols: unknown protocol {bad[:1] or protocols!r} "
                         f"(the {name} protocols: {', '.join(PROTOCOLS[name])})")
    fraction = options.get("val_fraction", 0.2)
    if name == "linear_probe" and not (isinstance(fraction, (int, float)) and 0 < fraction < 1):
        raise SuiteError(f"{where}.{name}.val_fraction: expected a fraction in (0, 1), got {fraction!r}")
    ks = options.get("recall_k", [1, 5, 10])
    if name == "retrieval" and not (isinstance(ks, list) and ks and all(isinstance(k, int) and k >= 1 for k in ks)):
        raise SuiteError(f"{where}.{name}.recall_k: expected a list of positive integers, got {ks!r}")
    if name == "linear_probe" and "clip_benchmark" in options:
        fit = options["clip_benchmark"]
        if not isinstance(fit, dict):
            raise SuiteError(
                f"{where}.{name}.clip_benchmark: expected a mapping of lr, epochs, batch_size, got {fit!r}"
            )
        _unknown(fit, ("lr", "epochs", "batch_size"), f"{where}.{name}.clip_benchmark")
    if name == "linear_probe" and "val" in options:
        options["val"] = _path(options["val"], f"{where}.{name}.val")
    return TaskSpec(name, protocols, options)


def _tasks(value: Any, where: str) -> list[TaskSpec]:
    if isinstance(value, list):
        items = [(t, None) for t in value]
    elif isinstance(value, dict):
        items = list(value.items())
    else:
        raise SuiteError(f"{where}: expected a list of tasks or a mapping task -> options, got {value!r}")
    if not items:
        raise SuiteError(f"{where}: no tasks")
    names = [n for n, _ in items]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise SuiteError(f"{where}: task {repeated!r} listed twice")
    return [_task(n, o, where) for n, o in items]


def _set(name: str, spec: Any, where: str) -> SetSpec:
    if not isinstance(spec, dict):
        raise SuiteError(f"{where}: expected a mapping (test, train, tasks, ...), got {spec!r}")
    _unknown(spec, SET_KEYS, where)
    if "test" not in spec:
        raise SuiteError(f"{where}: no 'test' set")
    if "tasks" not in spec:
        raise SuiteError(f"{where}: no 'tasks'")
    tasks = _tasks(spec["tasks"], f"{where}.tasks")
    test = _path(spec["test"], f"{where}.test")
    train = _path(spec["train"], f"{where}.train") if spec.get("train") is not None else None
    for task in tasks:
        if task.name in NEEDS_TRAIN and train is None:
            raise SuiteError(f"{where}.tasks.{task.name}: needs a 'train' set to fit on")
        if task.name == "retrieval" and is_image_folder(test):
            raise SuiteError(f"{where}.tasks.retrieval: {test!r} is an image folder, which has no captions")
    out = SetSpec(name, test, train, tasks, limit_train=_limit(spec.get("limit_train"), f"{where}.limit_train"),
                  limit_test=_limit(spec.get("limit_test"), f"{where}.limit_test"))
    wants_names = any(t.name in ("zero_shot", "linear_probe", "knn") for t in tasks)
    if wants_names or spec.get("classnames"):
        classnames = _path(spec["classnames"], f"{where}.classnames") if spec.get("classnames") else None
        try:
            out.classnames = read_classnames(test, classnames)
        except (OSError, ValueError) as err:
            if out.task("zero_shot"):
                raise SuiteError(f"{where}.tasks.zero_shot: needs class names: {err}") from None
    classifying = [t.name for t in tasks if t.name in ("zero_shot", "linear_probe", "knn")]
    if classifying and out.classnames is not None and len(out.classnames) < 2:
        # Every prediction of a one-class set is right: it scored 100 [100, 100] and lifted the
        # suite's averages.
        raise SuiteError(f"{where}.tasks.{classifying[0]}: the set has one class ({out.classnames[0]!r}), so every "
                         "prediction is right; classification needs two classes or more (retrieval alone scores it)")
    if out.task("zero_shot"):
        templates = _path(spec["templates"], f"{where}.templates") if spec.get("templates") else None
        try:
            out.templates = read_templates(test, templates)
        except (OSError, ValueError) as err:
            raise SuiteError(f"{where}.templates: {err}") from None
    return out


def parse_suite(data: Any, path: str = "<suite>") -> Suite:
    """A suite from its parsed YAML.

    Args:
        data: the YAML document.
        path: the file, named in errors.

    Returns:
        The suite, every path resolved and every set's class names and templates read.

    Raises:
        SuiteError: the first problem, naming ``path`` and the entry.
    """
    try:
        if not isinstance(data, dict):
            raise SuiteError(f"expected a mapping with 'sets', got {type(data).__name__}")
        _unknown(data, SUITE_KEYS, "suite")
        sets = data.get("sets")
        if not isinstance(sets, dict) or not sets:
            raise SuiteError("sets: expected a mapping of set name -> {test, train, tasks}")
        resamples, seed = data.get("resamples", 1000), data.get("seed", 0)
        if not isinstance(resamples, int) or resamples < 1:
            raise SuiteError(f"resamples: expected a positive integer, got {resamples!r}")
        if not isinstance(seed, int):
            raise SuiteError(f"seed: expected an integer, got {seed!r}")
        bad = next((n for n in sets if not isinstance(n, str) or not n or "/" in n or os.sep in n), None)
        if bad is not None:
            raise SuiteError(f"sets: {bad!r} is not a set name (a file-name part without '/')")
        return Suite(path, [_set(n, s, f"sets.{n}") for n, s in sets.items()], resamples, seed)
    except SuiteError as err:
        raise SuiteError(f"{path}: {err}") from None


def load_suite(path: str) -> Suite:
    """Read and check a suite file (see the module docstring).

    Raises:
        FileNotFoundError: no file at ``path``.
        SuiteError: bad YAML or a bad entry, naming it.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--suite: no file at {path!r}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise SuiteError(f"{path}: not YAML: {' '.join(str(err).split())}") from None
    return parse_suite(data, path)
