"""Where a labelled evaluation set's shards and side files are, in the layouts users have:
clip_benchmark ``wds/`` folders, shard folders with ``cls``, and class folders.

1. **clip_benchmark's webdataset layout** (``clip_benchmark eval --dataset wds/NAME
   --dataset_root DIR``; its ``datasets/builder.py`` ``build_wds_dataset``)::

       DIR/classnames.txt                          one class name per line, in label order
       DIR/zeroshot_classification_templates.txt   one prompt per line with ``{c}`` (optional)
       DIR/{split}/nshards.txt                     N, the number of shards
       DIR/{split}/0.tar .. DIR/{split}/{N-1}.tar  samples with an image (webp/png/jpg/jpeg) and ``cls``

   mmssl takes either ``DIR/{split}`` or ``DIR`` (meaning its ``test`` split, clip_benchmark's
   default ``--split``), reads the shards in clip_benchmark's order (``0.tar`` .. ``N-1.tar``,
   as ``nshards.txt`` says) and the class names and templates from the split folder if they are
   there, else from ``DIR``. Every labelled set mmssl writes is laid out this way
   (:func:`write_clip_benchmark_files`).
2. **A folder of ``*.tar`` shards** (or a brace pattern / ``::``-joined list) whose samples carry
   an image and ``cls``, with ``classnames.txt`` (and the optional templates file) beside the
   shards: mmssl's earlier layout, still read.
3. **Image folders** (torchvision ``ImageFolder``, the ImageNet layout): one sub-folder per class;
   labels follow the sorted folder names, and class names come from ``classnames.txt`` when
   present, else from the folder names.

``classnames.txt`` holds one name per line, in label order: a blank line among the names or a name
given twice is refused, naming the file and line (either would shift or merge every later class).

This module finds a set's shards and reads its side files; :mod:`mmssl.data.labeled` loads it.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES as _OPENAI_TEMPLATE_FNS
from torchvision.datasets.folder import find_classes

from mmssl.data.folders import is_class_folder
from mmssl.data.sources import expand_urls

# The 80 ImageNet prompts of CLIP (Radford et al. 2021, notebook "Prompt_Engineering_for_ImageNet"),
# taken from the copy open_clip ships (``zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES``, lambdas)
# and written with the ``{c}`` placeholder our template files use. Used when a set has no file.
OPENAI_IMAGENET_TEMPLATES: tuple[str, ...] = tuple(fn("{c}") for fn in _OPENAI_TEMPLATE_FNS)
DEFAULT_TEMPLATES = OPENAI_IMAGENET_TEMPLATES
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
NSHARDS_FILE = "nshards.txt"
DEFAULT_SPLIT = "test"  # clip_benchmark's default --split


def is_wds_split(folder: str) -> bool:
    """True when ``folder`` is a split of a clip_benchmark ``wds/`` set (it holds ``nshards.txt``)."""
    return os.path.isfile(os.path.join(folder, NSHARDS_FILE))


def _wds_splits(folder: str) -> list[str]:
    """The clip_benchmark splits (sub-folders with ``nshards.txt``) of a folder, sorted."""
    if not os.path.isdir(folder):
        return []
    return sorted(e for e in os.listdir(folder) if is_wds_split(os.path.join(folder, e)))


def resolve_labeled(data: str, split: str = DEFAULT_SPLIT) -> str:
    """The shards of a labelled set: a clip_benchmark root ``DIR`` becomes ``DIR/{split}``.

    Args:
        data: a labelled set in any layout of this module.
        split: the split a clip_benchmark root stands for (clip_benchmark's default, ``test``).

    Returns:
        ``data`` itself, or its split folder when ``data`` is a clip_benchmark root.

    Raises:
        FileNotFoundError: ``data`` is a clip_benchmark root without that split.
    """
    splits = _wds_splits(data)
    if not splits or is_wds_split(data):
        return data
    if split not in splits:
        raise FileNotFoundError(
            f"labelled set {data!r} is a clip_benchmark wds/ folder without a {split!r} split "
            f"(it has {splits}): pass {os.path.join(data, splits[0])!r} or another split folder"
        )
    return os.path.join(data, split)


def shard_urls(data: str) -> list[str]:
    """Every shard of a labelled set, in the order clip_benchmark reads them.

    A clip_benchmark split reads ``0.tar .. N-1.tar`` with N from ``nshards.txt`` (numeric order,
    where a plain folder listing sorts ``10.tar`` before ``2.tar``); anything else goes through
    :func:`mmssl.data.sources.expand_urls`.

    Raises:
        FileNotFoundError: ``nshards.txt`` names shards that are not there.
        ValueError: ``nshards.txt`` does not hold a positive integer.
    """
    data = resolve_labeled(data)
    if not (os.path.isdir(data) and is_wds_split(data)):
        return expand_urls(data)
    path = os.path.join(data, NSHARDS_FILE)
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{path}: expected the number of shards, found {text[:20]!r}")
    urls = [os.path.join(data, f"{i}.tar") for i in range(int(text))]
    missing = [u for u in urls if not os.path.isfile(u)]
    if missing:
        raise FileNotFoundError(
            f"{path} says {text} shards (0.tar .. {int(text) - 1}.tar), but {missing[:3]} are missing"
        )
    return urls


def _meta_folders(data: str) -> list[str]:
    """Folders that may hold ``classnames.txt`` and the templates, first match wins: the shards'
    folder, then, for a clip_benchmark split, the set's root (where clip_benchmark reads them)."""
    data = resolve_labeled(data)
    folder = data if os.path.isdir(data) else os.path.dirname(expand_urls(data, must_exist=False)[0])
    return [folder, os.path.dirname(os.path.abspath(folder))] if is_wds_split(folder) else [folder]


def _find_meta(data: str, name: str) -> tuple[Optional[str], list[str]]:
    """The first ``name`` file among :func:`_meta_folders` (or ``None``) and the paths tried."""
    tried = [os.path.join(folder, name) for folder in _meta_folders(data)]
    return next((p for p in tried if os.path.isfile(p)), None), tried


def is_image_folder(data: str) -> bool:
    """True when ``data`` is a folder of class sub-folders holding images (no ``*.tar`` shards, no
    clip_benchmark splits): the same test the training data uses (:func:`is_class_folder`)."""
    return is_class_folder(data) and not is_wds_split(data) and not _wds_splits(data)


def read_classnames(data: str, path: Optional[str] = None) -> list[str]:
    """Class names in label order.

    Args:
        data: the labelled set (clip_benchmark folder or split, folder of shards, shard pattern,
            or image folder).
        path: an explicit class-names file; defaults to ``classnames.txt`` beside the shards,
            else (clip_benchmark split) at the set's root.

    Returns:
        One name per class. An image folder without ``classnames.txt`` names its classes after
        its sorted sub-folders (``_`` read as a space).

    Raises:
        ValueError: the file is empty, not UTF-8, or has a blank line among the names or a name
            twice (file and line named).
    """
    folder_classes = find_classes(data)[0] if path is None and is_image_folder(data) else None
    if folder_classes is not None:
        path = os.path.join(data, CLASSNAMES_FILE)
        if not os.path.isfile(path):
            return [c.replace("_", " ") for c in folder_classes]
    elif path is None:
        path, tried = _find_meta(data, CLASSNAMES_FILE)
        if path is None:
            raise FileNotFoundError(
                f"labelled set {data!r} has no {CLASSNAMES_FILE} (looked for {' and '.join(map(repr, tried))})"
            )
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"no class-names file at {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            names = [line.strip() for line in f]
    except UnicodeDecodeError as exn:
        raise ValueError(f"{path} is not UTF-8 ({exn.reason} at byte {exn.start})") from None
    while names and not names[-1]:
        names.pop()  # blank lines at the end (a final newline) shift nothing
    problem = classnames_problem(names)
    if problem is not None:
        raise ValueError(f"{path}, line {problem[0] + 1}: {problem[1]}")
    if folder_classes is not None and len(names) != len(folder_classes):
        raise ValueError(f"{path} lists {len(names)} class names for the {len(folder_classes)} class folders "
                         f"of {data!r} (label i is the i-th folder in sorted order)")
    return names


def classnames_problem(names: Sequence[str]) -> Optional[tuple[int, str]]:
    """The first reason ``names`` cannot be a class list (label ``i`` is ``names[i]``), or ``None``.

    Returns:
        ``(index, reason)``: no names, an empty name (a blank line: every later label would name
        the next class), a line break inside a name, a name given twice, or two names that differ
        only in case or spacing (open_clip's tokenizer lower-cases and collapses whitespace, so
        both classes would get one zero-shot prompt and one classifier row).
    """
    if not names:
        return 0, "no class names"
    first: dict[str, int] = {}
    as_tokenized: dict[str, int] = {}
    for i, name in enumerate(names):
        if not name.strip():
            return i, "blank line among the class names (every later class would shift by one); remove it"
        if "\n" in name or "\r" in name:
            return i, f"class name {name!r} holds a line break"
        if name in first:
            return i, f"class name {name!r} repeats line {first[name] + 1}; each class needs its own name"
        key = " ".join(name.split()).lower()  # open_clip's clean: whitespace_clean(...).lower()
        if key in as_tokenized:
            j = as_tokenized[key]
            return i, (f"class name {name!r} differs from line {j + 1} ({names[j]!r}) only in case or spacing: the "
                       "tokenizer lower-cases prompts, so both classes would be one text; rename one")
        first[name], as_tokenized[key] = i, i
    return None


def read_templates(data: str, path: Optional[str] = None) -> list[str]:
    """Zero-shot prompt templates, each with a ``{c}`` placeholder.

    Args:
        data: the labelled set.
        path: an explicit templates file; defaults to ``zeroshot_classification_templates.txt``
            beside the shards, else (clip_benchmark split) at the set's root.

    Returns:
        The file's templates, or CLIP's 80 ImageNet templates when there is no file.
    """
    if path is not None and not os.path.isfile(path):
        raise FileNotFoundError(f"no templates file at {path!r}")
    if path is None:
        path = os.path.join(data, TEMPLATES_FILE) if is_image_folder(data) else _find_meta(data, TEMPLATES_FILE)[0]
        if path is None or not os.path.isfile(path):
            return list(DEFAULT_TEMPLATES)
    with open(path, encoding="utf-8") as f:
        lines = [(number, line.strip()) for number, line in enumerate(f, 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no templates (one a line, each with a '{{c}}' placeholder for the class name)")
    for number, template in lines:
        problem = _template_problem(template)
        if problem is not None:
            raise ValueError(f"{path}, line {number}: {template!r} {problem}")
    return [template for _, template in lines]


def _template_problem(template: str) -> Optional[str]:
    """Why ``template.format(c=name)`` would not give a prompt, or ``None``."""
    if "{c}" not in template:
        return "has no '{c}' placeholder for the class name"
    try:
        template.format(c="x")
    except (KeyError, IndexError, ValueError) as err:  # {d}, {0}, an unmatched brace
        return (f"cannot be filled with a class name alone ({type(err).__name__}: {err}); "
                "write a literal brace as {{ or }}")
    return None
