"""Stored teacher embeddings (MobileCLIP's "reinforced" data): side files joined to shards by key.

``tools/teacher_embeddings.py`` runs a teacher once over shards and writes, into one folder:

* ``teacher.json``, the manifest: the teacher's file and SHA-256, ``embed_dim``, ``logit_scale``,
  the image size and normalisation it saw the images at, and ``shards``: the identity of each local
  shard the embeddings were computed from (:func:`shard_identity`);
* one ``<shard>.npz`` per shard (``0.tar`` -> ``0.npz``): ``keys`` (N,) the samples' ``__key__``,
  ``image`` (N, D) and ``text`` (N, D) float32 L2-normalised embeddings, row i of sample ``keys[i]``.

Why side files rather than new shards with extra members: the shards stay as they are (no copy of
every image to add 2 x D floats, and a read-only or remote shard set still gets embeddings), one
set of shards can carry embeddings of several teachers, and the loader's plan, seeking and resume
state are untouched: the join happens in the decoder, by (shard file name, key). An ``.npz`` of
fixed-width arrays is read with ``allow_pickle=False``, so it carries no code.

In the loader (:class:`TeacherEmbeddings`), a sample whose shard has no side file, whose key is
not in it, or whose rows have another width than the manifest's is a bad sample: skipped, named
and counted toward ``data.max_bad_fraction`` like an unreadable image, never a crash mid-run.
A join by file name and key alone would join any shards so named (every ``make_shards`` set is
``0.tar ..`` with keys ``000000000 ..``): :func:`check_shards` refuses, at start-up, local training
shards other than those the manifest records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import zipfile
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np

from mmssl.data.decode import BadSample
from mmssl.data.sources import is_local

MANIFEST = "teacher.json"
FORMAT = "mmssl-teacher-embeddings/1"
KEY = "model.init_args.teacher_embeddings"
# Leading bytes of a shard hashed into its identity: its first samples' headers and bytes (two
# sets named alike differ there), one read per shard at start-up, not the shard.
HEAD_BYTES = 1 << 14
log = logging.getLogger(__name__)
# Side files a worker keeps open (a resampled stream revisits shards; each is N x 2D floats).
CACHED_SHARDS = 4


def side_file(folder: str, url: str) -> str:
    """The side file of shard ``url`` in ``folder``: its file name with ``.npz`` for ``.tar``."""
    stem = os.path.basename(str(url).rstrip("/"))
    stem = stem[:-4] if stem.endswith(".tar") else stem
    return os.path.join(folder, f"{stem}.npz")


def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest of a stored-embeddings folder, checked.

    Raises:
        FileNotFoundError: no folder or no ``teacher.json`` in it.
        ValueError: a manifest of another format, or without ``embed_dim`` / ``logit_scale``.
    """
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{KEY}: no {MANIFEST} in {folder!r} (tools/teacher_embeddings.py writes one)"
                                f"{_set_aside_hint(folder)}")
    with open(path) as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{KEY}: {path} is not JSON ({err})") from None
    if manifest.get("format") != FORMAT or "embed_dim" not in manifest or "logit_scale" not in manifest:
        raise ValueError(f"{KEY}: {path} is not a {FORMAT} manifest with embed_dim and logit_scale")
    # bool is an int to Python and JSON allows NaN: both passed, and failed later, far from here.
    dim, scale = manifest["embed_dim"], manifest["logit_scale"]
    if type(dim) is not int or dim < 1:
        raise ValueError(f"{KEY}: {path}: embed_dim must be a positive integer, got {dim!r}")
    if type(scale) not in (int, float) or not math.isfinite(scale):
        raise ValueError(f"{KEY}: {path}: logit_scale must be a finite number, got {scale!r}")
    return manifest


def shard_identity(url: str) -> Optional[dict[str, Any]]:
    """What tells a local shard file from another of the same name: its size in bytes and the
    SHA-256 of its first :data:`HEAD_BYTES` bytes; ``None`` for a URL, ``pipe:`` or virtual shard."""
    if not is_local(url) or not os.path.isfile(url):
        return None
    with open(url, "rb") as f:
        head = f.read(HEAD_BYTES)
    return {"bytes": os.path.getsize(url), "head_sha256": hashlib.sha256(head).hexdigest()}


def check_shards(folder: str, urls: Sequence[str]) -> None:
    """Refuse training shards other than those the embeddings in ``folder`` were computed from.

    Each local shard the manifest records by name must have the size and leading bytes recorded
    there (:func:`shard_identity`). Shards it does not name have no side file (their samples are bad
    samples); remote shards and manifests without ``shards`` cannot be checked and are warned about.

    Raises:
        ValueError: naming the manifest and the first shard that differs.
    """
    path = os.path.join(folder, MANIFEST)
    recorded = read_manifest(folder).get("shards")
    if not isinstance(recorded, dict):
        log.warning("%s: %s records no shard identities (written by an older tools/teacher_embeddings.py): the "
                    "training shards are joined to its embeddings by file name and key unchecked", KEY, path)
        return
    unchecked = 0
    for url in urls:
        want = recorded.get(os.path.basename(str(url).rstrip("/")))
        if want is None:
            continue
        have = shard_identity(str(url))
        if have is None:
            unchecked += 1
        elif any(have[k] != want.get(k) for k in have):
            raise ValueError(
                f"{KEY}: {path} holds embeddings of another shard named {os.path.basename(url)!r} "
                f"({want.get('bytes')} bytes, leading bytes SHA-256 {str(want.get('head_sha256'))[:12]}), not of "
                f"{url} ({have['bytes']} bytes, {have['head_sha256'][:12]}): run tools/teacher_embeddings.py "
                "on these shards")
    if unchecked:
        log.warning("%s: %d shards are remote or not files, so not checked against %s (joined by name and key)",
                    KEY, unchecked, path)


def _set_aside_hint(folder: str) -> str:
    """Where a ``--overwrite`` killed between the two renames of its swap left the earlier folder."""
    parent, name = os.path.split(os.path.normpath(os.path.abspath(folder)))
    if os.path.exists(folder) or not os.path.isdir(parent):
        return ""
    aside = sorted(e for e in os.listdir(parent) if e.startswith(f".{name}.old."))
    if not aside:
        return ""
    return (f"; an interrupted --overwrite set the earlier folder aside as {os.path.join(parent, aside[-1])!r}: "
            "rename it back, or run tools/teacher_embeddings.py again")


def write_side_file(path: str, keys: list[str], image: np.ndarray, text: np.ndarray) -> None:
    """Write one shard's embeddings (atomically: a partial file never has the final name).

    Args:
        path: the ``.npz`` file (:func:`side_file`).
        keys: the samples' ``__key__``, row order.
        image: (N, D) image embeddings.
        text: (N, D) text embeddings.
    """
    tmp = f"{path}.partial.npz"
    np.savez(tmp, keys=np.asarray(keys, dtype=str), image=image.astype(np.float32), text=text.astype(np.float32))
    os.replace(tmp, path)


class TeacherEmbeddings:
    """A worker's join of samples to their stored teacher embeddings (picklable; files opened lazily).

    Args:
        folder: the stored-embeddings folder (its manifest is read and checked here).
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.embed_dim: int = read_manifest(folder)["embed_dim"]
        self._shards: OrderedDict[str, Any] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "embed_dim": self.embed_dim, "_shards": OrderedDict()}

    def _shard(self, url: str) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
        path = side_file(self.folder, url)
        if path in self._shards:
            self._shards.move_to_end(path)
            return self._shards[path]
        try:
            with np.load(path, allow_pickle=False) as data:
                keys, image, text = data["keys"], data["image"], data["text"]
        except FileNotFoundError:
            found: Any = f"no teacher embeddings file {path}"
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            found = f"unreadable teacher embeddings file {path} ({type(err).__name__}: {err})"
        else:
            found = _rows(path, keys, image, text)
        self._shards[path] = found
        if len(self._shards) > CACHED_SHARDS:
            self._shards.popitem(last=False)
        return found

    def lookup(self, raw: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """``(image, text)`` (D,) float32 embeddings of a raw sample (its ``__url__`` and ``__key__``).

        Raises:
            BadSample: no side file for its shard, its key missing, or rows of another width.
        """
        found = self._shard(str(raw.get("__url__")))
        if isinstance(found, str):
            raise BadSample(found)
        rows, image, text = found
        key = str(raw.get("__key__"))
        if key not in rows:
            raise BadSample(f"no teacher embeddings for key {key!r} in {side_file(self.folder, raw.get('__url__'))}")
        i = rows[key]
        if image.ndim != 2 or text.ndim != 2 or image.shape[1] != self.embed_dim or text.shape[1] != self.embed_dim:
            raise BadSample(f"teacher embeddings of width {image.shape[1:]} / {text.shape[1:]} in "
                            f"{side_file(self.folder, raw.get('__url__'))}, the manifest says {self.embed_dim}")
        pair = np.asarray(image[i], dtype=np.float32), np.asarray(text[i], dtype=np.float32)
        if not (np.isfinite(pair[0]).all() and np.isfinite(pair[1]).all()):  # a NaN target trains NaN
            raise BadSample(f"non-finite teacher embeddings for key {key!r} in "
                            f"{side_file(self.folder, raw.get('__url__'))}")
        return pair


def _rows(path: str, keys: np.ndarray, image: np.ndarray, text: np.ndarray) -> Any:
    """``(key -> row, image, text)`` of a side file, or why its samples cannot be joined: a key
    given twice (which row is the sample's is unknown) or fewer rows than keys."""
    rows: dict[str, int] = {}
    for i, key in enumerate(keys):
        first = rows.setdefault(str(key), i)
        if first != i:
            return f"teacher embeddings file {path} holds key {str(key)!r} twice (rows {first} and {i})"
    if keys.ndim != 1 or len(image) != len(keys) or len(text) != len(keys):
        return (f"teacher embeddings file {path} holds {len(keys)} keys but {len(image)} image and {len(text)} text "
                "rows")
    return rows, image, text


def missing_side_files(folder: Optional[str], urls: list[str]) -> list[str]:
    """The shards of ``urls`` that have no side file in ``folder`` (for one warning at start-up)."""
    if folder is None:
        return []
    return [u for u in urls if not os.path.isfile(side_file(folder, u))]
