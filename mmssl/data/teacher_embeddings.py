"""Stored teacher embeddings (MobileCLIP's "reinforced" data): side files joined to shards by key.

``tools/teacher_embeddings.py`` runs a teacher once over shards and writes, into one folder:

* ``teacher.json``, the manifest: the teacher's file and SHA-256, ``embed_dim``, ``logit_scale``
  and the image size and normalisation it saw the images at;
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
"""

from __future__ import annotations

import json
import os
import zipfile
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from mmssl.data.decode import BadSample

MANIFEST = "teacher.json"
FORMAT = "mmssl-teacher-embeddings/1"
KEY = "model.init_args.teacher_embeddings"
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
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("embed_dim"), int) \
            or not isinstance(manifest.get("logit_scale"), (int, float)):
        raise ValueError(f"{KEY}: {path} is not a {FORMAT} manifest with embed_dim and logit_scale")
    return manifest


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
            found = ({str(k): i for i, k in enumerate(keys)}, image, text)
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
        return np.asarray(image[i], dtype=np.float32), np.asarray(text[i], dtype=np.float32)


def missing_side_files(folder: Optional[str], urls: list[str]) -> list[str]:
    """The shards of ``urls`` that have no side file in ``folder`` (for one warning at start-up)."""
    if folder is None:
        return []
    return [u for u in urls if not os.path.isfile(side_file(folder, u))]
