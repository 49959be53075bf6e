"""Image folders (``ROOT/<class>/<image>``, torchvision's ``ImageFolder`` layout) as a shard source.

A folder given as ``data.train_data`` / ``data.val_data`` is listed once per process (sorted, so
every rank and worker lists the same), its images put in an order drawn from a fixed seed (a
folder lists them class by class; the shuffle buffer only mixes nearby samples) and cut into
*virtual shards* of :data:`FOLDER_SHARD` images, named ``imagefolder:ROOT#00012``. From there on
they are shards like any tar: exact-epoch plans, the split over ranks and workers, mid-epoch
resume, resampling and weighting, bad-sample counting all apply unchanged. Each image is read as a
raw sample ``{"__key__": "<class>/<stem>", "<ext>": bytes, "cls": b"<label>", "txt": caption}``:
labels follow the sorted class-folder names (as ``ImageFolder``), captions are
``"a photo of a {class}."`` with ``_`` read as a space (as ``tools/make_shards.py --folder``
writes them), so MAE, CLIP and ``ImageClassifier`` all train from a folder.

Tar shards remain the better choice on network file systems (one large sequential read per
shard instead of one open per image): ``tools/make_shards.py --folder ROOT`` writes them.

:class:`LabeledFolder` reads a folder as a labelled evaluation set (the probes and zero-shot), in
``ImageFolder``'s order and with its labels, but decoding as the training stream does (the pixel
limit first) and reporting an unreadable image instead of stopping the evaluation.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import Dataset
from torchvision.datasets.folder import find_classes, make_dataset

from mmssl.data.decode import DEFAULT_MAX_IMAGE_PIXELS, BadSample, open_image

log = logging.getLogger("mmssl.data")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
SCHEME = "imagefolder:"
# Images per virtual shard: the unit the plan deals to ranks and workers, and validation's unit of
# work per slot; small enough that a 10k-image validation folder splits evenly over 8 ranks x 4 workers.
FOLDER_SHARD = 256
DEFAULT_TEMPLATE = "a photo of a {c}."


def shuffled(items: list, seed: int = 0) -> list:
    """``items`` in an order drawn from ``seed``: shards written from a class-ordered folder then
    mix classes, so a worker's shuffle buffer, which only mixes nearby samples, sees many classes."""
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def folder_items(root: str, template: str = DEFAULT_TEMPLATE) -> tuple[list[tuple[str, str, int]], list[str]]:
    """Samples of an image folder with one sub-folder per class.

    The listing is torchvision's own (``find_classes`` + ``make_dataset``, what ``ImageFolder``
    reads), so training from a folder and evaluating on it with the probes' ``ImageFolder`` give
    every image the same label.

    Args:
        root: the folder.
        template: caption template, ``{c}`` replaced by the class name (folder name, ``_`` -> space).

    Returns:
        ``(path, caption, label)`` per image, and the class names in label order.
    """
    try:
        classes, class_to_idx = find_classes(root)
    except FileNotFoundError:
        raise FileNotFoundError(f"{root!r} has no class sub-folders") from None
    names = [c.replace("_", " ") for c in classes]
    samples = make_dataset(root, class_to_idx, extensions=IMAGE_EXTENSIONS, allow_empty=True)
    return [(path, template.format(c=names[label]), label) for path, label in samples], names


def is_class_folder(path: str) -> bool:
    """Whether ``path`` is a local folder without tar shards whose sub-folders hold images."""
    if not os.path.isdir(path):
        return False
    with os.scandir(path) as entries:
        entries = list(entries)
    if any(e.name.endswith(".tar") for e in entries):
        return False
    for sub in (e for e in entries if e.is_dir()):
        with os.scandir(sub.path) as files:
            if any(os.path.splitext(f.name)[1].lower() in IMAGE_EXTENSIONS for f in files):
                return True
    return False


@functools.lru_cache(maxsize=16)
def _listing(root: str) -> tuple[tuple[str, str, int], ...]:
    """``(path, caption, label)`` of every image under ``root``, in the fixed shuffled order.

    Cached per process: planning lists the folder in the main process, and forked loader workers
    inherit the list instead of walking the folder again."""
    items, _ = folder_items(root)
    if not items:
        raise FileNotFoundError(f"image folder {root!r} holds no image ({', '.join(IMAGE_EXTENSIONS)}) "
                                "in its class sub-folders")
    return tuple(shuffled(items, seed=0))


def folder_urls(root: str) -> list[str]:
    """The virtual shard URLs of the image folder ``root`` (``imagefolder:ROOT#00000`` ...)."""
    root = os.path.abspath(root)
    shards = -(-len(_listing(root)) // FOLDER_SHARD)
    return [f"{SCHEME}{root}#{i:05d}" for i in range(shards)]


def is_folder_url(url: str) -> bool:
    return url.startswith(SCHEME)


def _parse(url: str) -> tuple[str, int]:
    root, _, index = url[len(SCHEME):].rpartition("#")
    return root, int(index)


def folder_shard_size(url: str) -> int:
    """Images in one virtual shard."""
    root, index = _parse(url)
    return len(_listing(root)[index * FOLDER_SHARD:(index + 1) * FOLDER_SHARD])


def folder_samples(
    url: str, first: int = 0, on_error: Optional[Callable[[str, Exception], object]] = None
) -> Iterator[tuple[int, dict]]:
    """``(offset, raw sample)`` of a virtual shard from image ``first`` on.

    Offsets are positions in the shard, so an unreadable file (reported to ``on_error(url, exn)``,
    then skipped, as a broken tar member is) shifts no other sample's position. Undecodable images
    are the decoder's business: they are skipped and counted there, like any bad sample.
    """
    root, index = _parse(url)
    items = _listing(root)[index * FOLDER_SHARD:(index + 1) * FOLDER_SHARD]
    for offset in range(first, len(items)):
        path, caption, label = items[offset]
        rel = os.path.relpath(path, root)
        stem, ext = os.path.splitext(rel)
        try:
            data = Path(path).read_bytes()
        except OSError as exn:
            if on_error is None:
                raise
            on_error(url, OSError(f"{path}: {exn.strerror or exn}"))
            continue
        yield offset, {"__key__": stem, "__url__": url, ext.lower().lstrip("."): data,
                       "cls": str(label).encode(), "txt": caption.encode()}


class LabeledFolder(Dataset):
    """An image folder as ``(transformed image, label)`` in :func:`folder_items`' order, the order
    and labels of torchvision's ``ImageFolder``; an image that cannot be used is ``None``.

    Args:
        root: the folder, one sub-folder per class.
        transform: PIL image -> tensor.
        max_pixels: an image whose header claims more pixels (width x height) is not decoded.
    """

    def __init__(self, root: str, transform: Callable, max_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.root, self.transform, self.max_pixels = root, transform, max_pixels
        self.items = [(path, label) for path, _, label in folder_items(root)[0]]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Optional[tuple[Any, int]]:
        path, label = self.items[index]
        try:
            image = open_image(Path(path).read_bytes(), max_pixels=self.max_pixels)
        except BadSample as exn:
            reason = str(exn)
        except Exception as exn:  # OSError from the file system; PIL's OSError, SyntaxError... on bad data
            reason = f"unreadable ({type(exn).__name__}: {exn})"
        else:
            return self.transform(image), label
        log.warning(f"labelled set: skipped image {os.path.relpath(path, self.root)!r} in {self.root}: {reason}")
        return None
