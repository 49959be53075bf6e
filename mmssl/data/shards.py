"""Write and check webdataset shards (img2dataset layout); ``tools/make_shards.py`` and
``tools/inspect_shards.py`` are thin command lines over these functions.

:func:`~mmssl.data.folders.shuffled` mixes the samples before they are written (a folder lists them class by class).
Shards hold ``{key}.jpg|png`` (or the original bytes), ``{key}.txt`` and, when labelled,
``{key}.cls``; a ``sizes.json`` beside them lists samples per shard (open_clip's convention),
which exact-epoch training needs. While shards are written, :data:`INCOMPLETE_FILE` stands beside
them (removed once ``sizes.json`` is written): a folder that holds it is an interrupted run's, which
:func:`inspect_shards` reports as incomplete and ``--overwrite`` replaces.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tarfile
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence

import webdataset as wds
from PIL import Image
from tqdm import tqdm

from mmssl.data.decode import BadSample, SampleDecoder, parse_label
from mmssl.data.label_files import CLASSNAMES_FILE, NSHARDS_FILE, TEMPLATES_FILE, classnames_problem
from mmssl.data.sources import INCOMPLETE_FILE, SIZES_FILE, expand_urls, is_local, read_sizes_json

# inspect_shards warns about a shard whose most common label or caption covers more than this
# fraction of its samples (a class-ordered shard: its batches would be nearly one class), once the
# shard holds at least MIN_SAMPLES_TO_JUDGE samples.
NEARLY_CONSTANT = 0.9
MIN_SAMPLES_TO_JUDGE = 10


def table_items(path: str) -> list[tuple[str, str, Optional[int]]]:
    """Samples of a CSV/TSV with columns ``path,caption[,label]`` (header optional).

    Relative image paths are taken from the table's folder.

    Raises:
        ValueError: the file is not UTF-8, or a row lacks a column, has an empty caption or a label
            that is no class index in [0, 2**63) (the bounds training applies,
            :func:`mmssl.data.decode.parse_label`); each names the file and line.
    """
    delimiter = "\t" if path.endswith((".tsv", ".tab")) else ","
    base = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start}): save it as "
                         "UTF-8") from None
    items = []
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    for i, row in enumerate(reader):
        where = f"{path}:{reader.line_num}"  # the row's last line (a quoted field may hold line breaks)
        if i == 0 and row and row[0].strip().lower() in ("path", "image", "filepath"):
            continue
        if len(row) < 2:
            raise ValueError(f"{where}: expected path,caption[,label], got {row}")
        if not row[1].strip():
            raise ValueError(f"{where}: empty caption for {row[0]!r} (training skips a sample without text)")
        label = None
        if len(row) > 2 and row[2].strip():
            try:
                label = parse_label(row[2], name="label")
            except ValueError as err:
                raise ValueError(f"{where}: {err} (a class index in [0, 2**63))") from None
        items.append((os.path.join(base, row[0]), row[1], label))
    return items


def _encode(path: str, resize: Optional[int]) -> tuple[str, bytes]:
    """Image file -> (extension, bytes); resized so the short side is ``resize`` when set."""
    ext = Path(path).suffix.lower().lstrip(".")
    if resize is None and ext in ("jpg", "jpeg", "png", "webp"):
        return ext, Path(path).read_bytes()  # stored as is: no re-encoding loss
    image = Image.open(path).convert("RGB")
    if resize is not None:
        scale = resize / min(image.size)
        if scale < 1:
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95)
    return "jpg", buf.getvalue()


def prepare_output(folder: str, overwrite: bool = False) -> None:
    """Make ``folder`` ready for new shards, deleting no file that mmssl did not write.

    A folder without ``*.tar``, ``sizes.json`` or :data:`INCOMPLETE_FILE` is used as it is. One with
    them is refused, unless ``overwrite``: then the shards its ``sizes.json`` lists (an earlier
    run's), or those named by an interrupted run's :data:`INCOMPLETE_FILE`, and those files are
    deleted; any other ``*.tar`` (which would be read beside the new shards) is still refused.

    Args:
        folder: the output folder (created).
        overwrite: replace an earlier or interrupted run's shards.

    Raises:
        FileExistsError: shards are there and ``overwrite`` is off, or some are not an earlier run's.
        ValueError: its ``sizes.json`` is malformed (with ``overwrite``).
    """
    os.makedirs(folder, exist_ok=True)
    sizes_path, marker = os.path.join(folder, SIZES_FILE), os.path.join(folder, INCOMPLETE_FILE)
    tars = sorted(e for e in os.listdir(folder) if e.endswith(".tar"))
    incomplete = os.path.exists(marker)
    if not tars and not os.path.exists(sizes_path) and not incomplete:
        return
    if not overwrite:
        held = (f"the shards of an interrupted run ({INCOMPLETE_FILE}: it stopped before writing {SIZES_FILE})"
                if incomplete else f"shards ({len(tars)} .tar files"
                f"{', a sizes.json' if os.path.exists(sizes_path) else ''})")
        raise FileExistsError(
            f"{folder} already holds {held}: write to another --output, or pass --overwrite to replace the shards "
            "an earlier run wrote there")
    if incomplete:
        written = _incomplete_pattern(marker)
        ours = {t for t in tars if written is not None and written.fullmatch(t)}
        where = f"named as its {INCOMPLETE_FILE} says the interrupted run named its shards"
    else:
        ours = set(read_sizes_json(sizes_path)) if os.path.exists(sizes_path) else set()
        where = "listed in its sizes.json"
    foreign = [t for t in tars if t not in ours]
    if foreign:
        raise FileExistsError(
            f"{folder}: {foreign[:3]}{' ...' if len(foreign) > 3 else ''} are not {where}, so no run of make_shards "
            "wrote them, and mmssl deletes no file it did not write: move them away, or write to another --output")
    for name in tars:
        os.remove(os.path.join(folder, name))
    for path in (sizes_path, marker):
        if os.path.exists(path):
            os.remove(path)


def _incomplete_pattern(marker: str) -> Optional[re.Pattern]:
    """The shard file names an interrupted writer used, from its :data:`INCOMPLETE_FILE`
    (``None`` if unreadable: killed while writing it, before any shard)."""
    try:
        with open(marker, encoding="utf-8") as f:
            pattern = json.load(f)["pattern"]
        head, width, tail = re.fullmatch(r"(.*)%0?(\d*)d(.*)", pattern).groups()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return re.compile(re.escape(head) + (rf"\d{{{int(width)},}}" if width else r"\d+") + re.escape(tail))


def write_shards(
    items: Iterable[tuple[str, str, Optional[int]]],
    output: str,
    shard_size: int = 10000,
    resize: Optional[int] = None,
    prefix: str = "",
    total: Optional[int] = None,
    overwrite: bool = False,
    numbered: bool = False,
) -> dict[str, int]:
    """Write samples to ``output/{prefix}{00000..}.tar`` and ``output/sizes.json``.

    Args:
        items: ``(image path, caption, label or None)``.
        output: output folder (created; refused if it holds shards, see :func:`prepare_output`).
        shard_size: samples per shard.
        resize: short side to shrink larger images to (JPEG re-encode); ``None`` keeps the bytes.
        prefix: shard file name prefix.
        total: number of items, for the progress bar.
        overwrite: replace the shards an earlier (or interrupted) run wrote into ``output``.
        numbered: name the shards ``0.tar, 1.tar, ..`` (clip_benchmark's names) instead.

    Returns:
        Samples per shard file name (what ``sizes.json`` holds).
    """
    prepare_output(output, overwrite)

    def samples():
        for i, (path, text, label) in enumerate(tqdm(items, total=total, desc="writing shards", unit="img")):
            ext, data = _encode(path, resize)
            yield {"__key__": f"{i:09d}", ext: data, "txt": text, **({"cls": str(label)} if label is not None else {})}

    return write_samples(samples(), os.path.join(output, "%d.tar" if numbered else f"{prefix}%05d.tar"), shard_size)


def write_samples(samples: Iterable[dict], pattern: str, shard_size: int) -> dict[str, int]:
    """Write webdataset samples to tar shards and the ``sizes.json`` beside them: the one shard
    writer of the project (``make_shards``, the demo data, ``tools/fashion_mnist.py``).

    :data:`INCOMPLETE_FILE` stands beside the shards until ``sizes.json`` is written. Fixed mtime
    and USTAR members (no 1 KiB pax header per member, which would triple the size of small
    samples): identical inputs give identical bytes.

    Args:
        samples: dicts of ``__key__`` and member bytes or strings (``jpg``, ``txt``, ``cls``, ...).
        pattern: shard path with one ``%d``-style field, e.g. ``out/%05d.tar``; its folder must exist.
        shard_size: samples per shard.

    Returns:
        Samples per shard file name, as written to ``sizes.json`` (open_clip's epoch-length file).
    """
    folder = os.path.dirname(pattern) or "."
    marker = Path(folder, INCOMPLETE_FILE)
    marker.write_text(json.dumps({"pattern": os.path.basename(pattern), "why": "shards are being written, or their "
                                  "writer was interrupted: sizes.json is written, and this file removed, at the end"}))
    sizes: dict[str, int] = {}
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0, mtime=0, format=tarfile.USTAR_FORMAT) as sink:
        for sample in samples:
            sink.write(sample)
            name = os.path.basename(sink.fname)
            sizes[name] = sizes.get(name, 0) + 1
    Path(folder, SIZES_FILE).write_text(json.dumps(sizes, indent=1))
    marker.unlink()
    return sizes


def label_problem(raw: bytes) -> Optional[str]:
    """Why a ``cls`` value is no usable class index (``None`` when it is one), by
    :func:`mmssl.data.decode.parse_label`, the bounds training applies."""
    try:
        parse_label(raw, name="cls")
    except ValueError as err:
        return str(err)
    return None


def inspect_shards(
    data: str, decoder: Optional[SampleDecoder] = None, show: int = 3
) -> tuple[int, list[str], list[dict], list[str]]:
    """Read every sample of some shards, validating each, and each shard against its ``sizes.json``.

    Args:
        data: shard spec (pattern, folder, ...).
        decoder: how samples are checked; default: image decodes, caption is non-empty UTF-8,
            ``cls`` is an integer class index (:func:`label_problem`).
        show: how many good samples to return for printing.

    Returns:
        ``(good count, problems, first samples, warnings)``; problems are one line each naming
        shard and key, or shard and its ``sizes.json`` (malformed, or a count that differs from the
        samples the shard holds); warnings name shards whose labels or captions are nearly
        constant, or that no ``sizes.json`` lists.
    """
    decoder = decoder or SampleDecoder(_identity, tokenizer=list)
    problems: list[str] = []
    warnings: list[str] = []
    shown: list[dict] = []
    good = 0

    def on_error(url: str, exn: Exception) -> bool:
        problems.append(f"{url}: unreadable ({type(exn).__name__}: {exn.args[0] if exn.args else ''})")
        return True

    urls = expand_urls(data, incomplete_ok=True)  # reported as a problem below
    listed = _listed_sizes(urls, problems)
    for url in tqdm(urls, desc="checking shards", unit="shard"):
        values: dict[str, Counter] = {"label": Counter(), "caption": Counter()}
        held = 0
        for sample in wds.tarfile_samples([{"url": url}], handler=lambda e, u=url: on_error(u, e)):
            held += 1
            try:
                decoded = decoder(sample)
                reason = label_problem(sample[decoder.label_key]) if decoder.label_key in sample else None
                if reason:
                    raise BadSample(reason)
            except BadSample as exn:
                problems.append(f"{url} {sample.get('__key__')!r}: {exn}")
                continue
            good += 1
            values["label"].update([decoded["label"]] if "label" in decoded else [])
            values["caption"].update([decoded["text"]] if "text" in decoded else [])
            if len(shown) < show:
                shown.append(_summary(sample))
        warnings += _nearly_constant(url, values)
        problems += _size_problems(url, held, listed, warnings)
    return good, problems, shown, warnings


def _listed_sizes(urls: list[str], problems: list[str]) -> dict[str, Optional[dict[str, int]]]:
    """Each local folder's ``sizes.json`` (``None``: there is none, or it is malformed or its writer
    was interrupted: a problem)."""
    out: dict[str, Optional[dict[str, int]]] = {}
    for folder in sorted({os.path.dirname(u) for u in urls if is_local(u)}):
        path = os.path.join(folder, SIZES_FILE)
        out[folder] = None
        if os.path.exists(os.path.join(folder, INCOMPLETE_FILE)):
            problems.append(f"{folder}: incomplete: its writer (tools/make_shards.py) stopped before writing "
                            f"{SIZES_FILE} ({INCOMPLETE_FILE} is there), so its last shard may be cut short and "
                            "shards may be missing: run it again with --overwrite")
        elif os.path.exists(path):
            try:
                out[folder] = read_sizes_json(path)
            except ValueError as err:
                problems.append(str(err))
    return out


def _size_problems(url: str, held: int, listed: dict[str, Optional[dict[str, int]]], warnings: list[str]) -> list[str]:
    folder, name = os.path.split(url)
    sizes = listed.get(folder)
    if sizes is None:
        return []
    if name not in sizes:
        warnings.append(f"{url}: not listed in {os.path.join(folder, SIZES_FILE)} (exact epochs count its samples "
                        "at start-up)")
        return []
    if sizes[name] != held:
        return [f"{url}: holds {held} samples, {os.path.join(folder, SIZES_FILE)} lists {sizes[name]} (training "
                "would count the difference as bad samples; rewrite it with tools/make_shards.py or fix the entry)"]
    return []


def _nearly_constant(url: str, values: dict[str, Counter]) -> list[str]:
    lines = []
    for what, counts in values.items():
        total = sum(counts.values())
        if total >= MIN_SAMPLES_TO_JUDGE:
            value, top = counts.most_common(1)[0]
            if top > NEARLY_CONSTANT * total:
                lines.append(f"{url}: {top} of {total} samples have the {what} {value!r}; batches drawn from it "
                             f"will be nearly one {what} (write shards with tools/make_shards.py, which shuffles)")
    return lines


def _summary(sample: dict) -> dict:
    out = {"key": sample["__key__"], "url": sample["__url__"]}
    for k, v in sample.items():
        if not k.startswith("__"):
            out[k] = v.decode("utf-8", "replace")[:80] if k in ("txt", "cls", "json") else f"{len(v)} bytes"
    return out


def _identity(image):  # the default check decodes the image and keeps it as is
    return image


def clip_benchmark_shard_pattern(root: str, split: str) -> str:
    """``wds.ShardWriter`` pattern of a clip_benchmark split: ``root/split/%d.tar`` (``0.tar``, ...,
    unpadded, the names its ``{0..N-1}.tar`` brace pattern expands to)."""
    return os.path.join(root, split, "%d.tar")


def write_clip_benchmark_files(
    root: str, split: str, classnames: Optional[Sequence[str]] = None, templates: Optional[Sequence[str]] = None
) -> int:
    """Finish a clip_benchmark split whose shards ``root/split/0.tar ..`` are written.

    Writes ``root/split/nshards.txt`` and, at ``root`` (where clip_benchmark reads them),
    ``classnames.txt`` and ``zeroshot_classification_templates.txt`` when given.

    Args:
        root: the set's folder (clip_benchmark's ``--dataset_root``).
        split: the split folder's name (clip_benchmark's ``--split``: ``train``, ``test``, ...).
        classnames: class names in label order.
        templates: zero-shot prompts, each with ``{c}``.

    Returns:
        The number of shards.

    Raises:
        FileNotFoundError: no ``0.tar`` in the split.
        ValueError: other ``*.tar`` files beside ``0.tar .. N-1.tar`` (clip_benchmark would skip
            them), class names that :func:`read_classnames` would refuse, or a template without ``{c}``.
    """
    folder = os.path.join(root, split)
    n = 0
    while os.path.isfile(os.path.join(folder, f"{n}.tar")):
        n += 1
    if n == 0:
        raise FileNotFoundError(f"no shard {os.path.join(folder, '0.tar')!r} to list in {NSHARDS_FILE}")
    stray = sorted(set(e for e in os.listdir(folder) if e.endswith(".tar")) - {f"{i}.tar" for i in range(n)})
    if stray:
        raise ValueError(f"{folder}: shards {stray[:3]} are not among 0.tar .. {n - 1}.tar, which clip_benchmark reads")
    with open(os.path.join(folder, NSHARDS_FILE), "w", encoding="utf-8") as f:
        f.write(f"{n}\n")
    if classnames is not None:
        problem = classnames_problem(classnames)
        if problem is not None:
            raise ValueError(f"classnames[{problem[0]}]: {problem[1]}")
        with open(os.path.join(root, CLASSNAMES_FILE), "w", encoding="utf-8") as f:
            f.write("\n".join(classnames) + "\n")
    if templates is not None:
        bad = [t for t in templates if "{c}" not in t]
        if bad or not templates:
            raise ValueError(f"every zero-shot template needs a '{{c}}' placeholder; bad: {bad[:3]}")
        with open(os.path.join(root, TEMPLATES_FILE), "w", encoding="utf-8") as f:
            f.write("\n".join(templates) + "\n")
    return n
