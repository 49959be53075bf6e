"""Shard sources: what users type in ``data.train_data`` / ``data.val_data`` -> lists of shard URLs.

Accepted specs:

- a brace pattern, ``data/{00000..00099}.tar`` (expanded with ``braceexpand``, as webdataset and
  open_clip do);
- a local path may start with ``~`` (expanded, as a shell would);
- several specs joined with ``::`` (open_clip's ``--train-data`` convention), concatenated;
- a folder: every ``*.tar`` inside, sorted;
- an image folder, ``ROOT/<class>/<image>`` (torchvision's ``ImageFolder`` layout): read as virtual
  shards (:mod:`mmssl.data.folders`), labels from the sorted class names;
- any URL or ``pipe:`` command that webdataset's ``gopen`` opens (``pipe:aws s3 cp ... -``): a
  ``pipe:`` source runs its command in a shell, so a config that names one is trusted like code;
  specs read from data files (an evaluation suite) refuse it (:func:`refuse_pipe`);
- a YAML list of any of these: one source made of all of them;
- a YAML list of mappings ``{data: SPEC, weight: W}``: weighted mixing of several sources, drawn
  in proportion to ``W`` (resampled mode only; exact epochs read every sample once and so cannot
  weight).
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import braceexpand
from webdataset.tariterators import base_plus_ext

from mmssl.data.folders import IMAGE_EXTENSIONS, folder_shard_size, folder_urls, is_class_folder, is_folder_url

log = logging.getLogger("mmssl.data")

# Beside shards being written by tools/make_shards.py (their file-name pattern inside), removed once
# sizes.json is: a killed writer leaves whole-looking tars, which this file marks as an interrupted
# run's (its last shard may be cut short, later shards missing).
INCOMPLETE_FILE = "incomplete.json"

# What the config accepts; jsonargparse validates against this.
DataSpec = Union[str, list[Union[str, dict[str, Any]]]]


@dataclass(frozen=True)
class Source:
    """One source of shards.

    Attributes:
        urls: its shard URLs.
        weight: relative share of the mix (resampled mode).
        spec: what the user wrote, for error messages.
    """

    urls: tuple[str, ...]
    weight: float = 1.0
    spec: str = ""


def refuse_pipe(spec: str, where: str) -> None:
    """Refuse a ``pipe:`` command in a shard spec read from a data file (not a config).

    webdataset runs ``pipe:CMD`` with ``shell=True``: a file that is shared and opened as data (an
    evaluation suite) must not run commands when read. Any occurrence is refused, so that neither a
    ``::`` list nor a brace pattern can spell one.

    Args:
        spec: the shard spec as written.
        where: the file and key, for the error.

    Raises:
        ValueError: ``spec`` holds ``pipe:``.
    """
    if "pipe:" in spec:
        raise ValueError(f"{where}: {spec!r} is a pipe: source, which runs a shell command; a data file may not "
                         "name one (write the shards to disk, or pass the pipe: spec on the command line or in a "
                         "config, which are trusted like code)")


def is_local(url: str) -> bool:
    """Whether ``url`` is a local path (not ``pipe:``, not ``scheme://``)."""
    return not url.startswith("pipe:") and "://" not in url and not url.startswith("file:")


def expand_urls(pattern: Union[str, Sequence[str]], must_exist: bool = True, incomplete_ok: bool = False) -> list[str]:
    """Expand a shard spec into URLs.

    Args:
        pattern: brace pattern (``data/{00000..00099}.tar``), several joined with ``::``, a
            folder (every ``*.tar`` inside, sorted), an image folder with class sub-folders (its
            virtual shards, :mod:`mmssl.data.folders`), a URL or ``pipe:`` command, or a list of these.
        must_exist: check that local shards exist (planning from ``sizes.json`` alone does not).
        incomplete_ok: accept shards in a folder that :data:`INCOMPLETE_FILE` marks as an
            interrupted writer's (``inspect_shards`` reports it instead).

    Returns:
        The list of shard URLs, in the order given.

    Raises:
        FileNotFoundError: a folder holds no ``.tar`` shard, or a local shard does not exist.
        ValueError: a local shard's folder holds :data:`INCOMPLETE_FILE`, naming the folder.
    """
    parts = [pattern] if isinstance(pattern, str) else list(pattern)
    urls: list[str] = []
    for spec in parts:
        for part in spec.split("::"):
            part = part.strip()
            if not part:
                continue
            local = is_local(part)
            if local:
                part = os.path.expanduser(part)  # a config's `~/...` (no shell expands it there)
            if local and is_class_folder(part):
                urls += folder_urls(part)
            elif local and os.path.isdir(part):
                found = sorted(os.path.join(part, f) for f in os.listdir(part) if f.endswith(".tar"))
                if not found:
                    raise FileNotFoundError(
                        f"no .tar shards in folder {part!r} (looked for {os.path.join(part, '*.tar')}), and no "
                        f"class sub-folders of images ({', '.join(IMAGE_EXTENSIONS)}) either; write shards with "
                        "tools/make_shards.py or point data.train_data at a brace pattern"
                    )
                urls += found
            else:
                urls += list(braceexpand.braceexpand(part))
    missing = [u for u in urls if must_exist and is_local(u) and not is_folder_url(u) and not os.path.exists(u)]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of {len(urls)} shards of {pattern!r} do not exist, e.g. {missing[:3]}"
        )
    if not urls:
        raise FileNotFoundError(f"shard spec {pattern!r} names no shard")
    if not incomplete_ok:
        refuse_incomplete(urls)
    return urls


def refuse_incomplete(urls: Sequence[str]) -> None:
    """Refuse local shards whose folder an interrupted ``tools/make_shards.py`` left.

    Raises:
        ValueError: a folder holds :data:`INCOMPLETE_FILE`, naming the folder and the way out.
    """
    for folder in dict.fromkeys(os.path.dirname(u) for u in urls if is_local(u) and not is_folder_url(u)):
        if os.path.exists(os.path.join(folder or ".", INCOMPLETE_FILE)):
            raise ValueError(
                f"{folder} is incomplete: its writer (tools/make_shards.py) stopped before writing {SIZES_FILE} "
                f"({INCOMPLETE_FILE} is there), so its last shard may be cut short and shards may be missing: "
                "run make_shards again with --overwrite (tools/inspect_shards.py checks the result)")


def parse_sources(spec: DataSpec) -> list[Source]:
    """Turn a ``train_data`` value into sources.

    Args:
        spec: a string or list of strings (one source), or a list of ``{data, weight}`` mappings
            (one source each, mixed by weight).

    Returns:
        The sources, each with its expanded URLs.
    """
    if isinstance(spec, str):
        return [Source(tuple(expand_urls(spec)), 1.0, spec)]
    items = list(spec)
    if all(isinstance(item, str) for item in items):
        return [Source(tuple(expand_urls(items)), 1.0, "::".join(items))]
    sources = []
    for item in items:
        if isinstance(item, str):
            item = {"data": item}
        unknown = set(item) - {"data", "weight"}
        if "data" not in item or unknown:
            raise ValueError(f"a weighted source is {{data: SHARDS, weight: W}}; got {item!r}")
        weight = float(item.get("weight", 1.0))
        if weight <= 0:
            raise ValueError(f"source {item['data']!r}: weight must be > 0, got {weight}")
        sources.append(Source(tuple(expand_urls(item["data"])), weight, str(item["data"])))
    return sources


def count_tar(path: str) -> int:
    """Samples (distinct keys, webdataset's grouping) in a local tar, reading headers only."""
    keys = set()
    with tarfile.open(path) as tar:
        for member in tar:
            if member.isreg() and not os.path.basename(member.name).startswith("__"):
                key, _ = base_plus_ext(member.name)
                if key is not None:
                    keys.add(key)
    return len(keys)


SIZES_FILE = "sizes.json"


def read_sizes_json(path: str) -> dict[str, int]:
    """A ``sizes.json`` (open_clip's convention: shard file name -> samples), validated.

    Args:
        path: the file.

    Returns:
        Samples per shard file name.

    Raises:
        ValueError: the file is not JSON, not a mapping of shard file names to non-negative
            integers below 2**63; the message names the file and the first entries at fault.
    """
    try:
        with open(path, encoding="utf-8") as f:
            sizes = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON (line {err.lineno} column {err.colno}: {err.msg}); it must map "
            'shard file names to samples, {"00000.tar": 10000, ...} (tools/make_shards.py writes one)'
        ) from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not isinstance(sizes, dict):
        raise ValueError(f"{path} holds a {type(sizes).__name__}, not a mapping of shard file names to samples "
                         '({"00000.tar": 10000, ...})')
    # Below 2**63: counts are summed and planned as int64 (torch, numpy); a larger one overflowed
    # there, far from the file, with an unnamed OverflowError.
    bad = [(k, v) for k, v in sizes.items() if type(v) is not int or not 0 <= v < 2**63]
    if bad:
        shown = ", ".join(f"{k!r}: {v!r}" for k, v in bad[:3])
        raise ValueError(f"{path}: every value must be a non-negative integer below 2**63 (samples in the shard); "
                         f"{len(bad)} are not: {shown}{' ...' if len(bad) > 3 else ''}")
    return sizes


def _sizes_beside(url: str) -> dict[str, int]:
    """The validated ``sizes.json`` in a local shard's folder, empty when there is none."""
    path = os.path.join(os.path.dirname(url), SIZES_FILE)
    return read_sizes_json(path) if is_local(url) and os.path.exists(path) else {}


def shard_sizes(urls: Sequence[str], scan: bool = True) -> Optional[list[int]]:
    """Samples per shard, from the ``sizes.json`` beside the shards (open_clip's convention).

    Args:
        urls: shard URLs.
        scan: count the samples of local shards that no ``sizes.json`` lists (headers only).

    Returns:
        One count per URL, or ``None`` when some shard is neither listed nor countable.

    Raises:
        ValueError: a ``sizes.json`` that is malformed (:func:`read_sizes_json`).
    """
    sizes, cache = [], {}
    for url in urls:
        if is_folder_url(url):
            sizes.append(folder_shard_size(url))
            continue
        folder, name = os.path.split(url)
        if folder not in cache:
            cache[folder] = _sizes_beside(url)
        if name in cache[folder]:
            sizes.append(cache[folder][name])
        elif scan and is_local(url):
            try:
                sizes.append(count_tar(url))
            except (tarfile.TarError, OSError) as err:
                log.warning(f"shard {url} cannot be read ({type(err).__name__}: {err}): it is left out of the "
                            "epoch plan")
                sizes.append(0)
        else:
            return None
    return sizes


def sizes_origin(urls: Sequence[str]) -> str:
    """Where :func:`shard_sizes` takes the sizes of ``urls`` from, for messages."""
    files = sorted({os.path.join(os.path.dirname(u), SIZES_FILE) for u in urls if is_local(u) and not is_folder_url(u)})
    listed = [f for f in files if os.path.exists(f)]
    if not listed:
        return "counted in the shards"
    return f"as listed by {listed[0]}" + (f" and {len(listed) - 1} other sizes.json" if len(listed) > 1 else "")


def count_samples(urls: Sequence[str]) -> Optional[int]:
    """Total samples of ``urls`` from ``sizes.json`` files (no scanning); ``None`` if unlisted."""
    sizes = shard_sizes(urls, scan=False)
    return None if sizes is None else sum(sizes)
