"""Fashion-MNIST idx files -> webdataset shards with captions, in the clip_benchmark layout.

    apt-get install dataset-fashion-mnist     # idx files in /usr/share/datasets/fashion-mnist
    python tools/fashion_mnist.py --output data/fashion_mnist

writes a clip_benchmark ``wds/`` set: ``train/`` (60000 samples, 12 shards) and ``test/`` (10000,
2 shards), each a folder of shards ``0.tar ..`` whose samples hold ``png`` (the 28x28 grey image,
lossless), ``txt`` (a caption naming the class), ``cls`` (label index), plus ``nshards.txt``
(clip_benchmark's) and ``sizes.json`` (samples per shard, open_clip's); ``classnames.txt`` and
``zeroshot_classification_templates.txt`` lie at the output root, where clip_benchmark reads
them. Each split folder serves ``--data.train_data``, zero-shot and probes alike, and
``clip_benchmark eval --dataset wds/fashion_mnist --dataset_root OUTPUT`` reads the test split.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import random
import struct
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from mmssl.data.shards import prepare_output, write_clip_benchmark_files, write_samples
from mmssl.tools._common import add_option, run

DEFAULT_SOURCE = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
# Label order of the idx files (Xiao et al. 2017, github.com/zalandoresearch/fashion-mnist).
CLASSNAMES: tuple[str, ...] = (
    "t-shirt", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)
# Captions vary the phrasing so CLIP must find the class word, not memorise one sentence.
CAPTION_TEMPLATES: tuple[str, ...] = (
    "a photo of a {c}.",
    "a black and white photo of a {c}.",
    "a grayscale product image of a {c}.",
    "a low resolution photo of a {c}.",
    "a {c} on a black background.",
    "a small picture of a {c}.",
)
# Zero-shot prompts (in the style of CLIP's templates; clip_benchmark's fashion-mnist-less list).
ZERO_SHOT_TEMPLATES: tuple[str, ...] = (
    "a photo of a {c}.",
    "a black and white photo of a {c}.",
    "a grayscale product image of a {c}.",
    "a picture of a {c}.",
)
SPLITS = {"train": "train", "test": "t10k"}  # our folder name -> idx file prefix
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Read an idx file (LeCun's MNIST format), gzipped or not.

    Format: two zero bytes, a dtype code, the number of dimensions, then each dimension as a
    big-endian uint32, then the data in C order.

    Args:
        path: ``*-idx?-ubyte`` or ``*-idx?-ubyte.gz``.

    Returns:
        The array, shaped as the header says.

    Raises:
        ValueError: if the header is not an idx header or the data is short.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an idx file (bad magic {raw[:4]!r})")
    ndim = raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    data = raw[4 + 4 * ndim :]
    if len(data) != expected:
        raise ValueError(f"{path}: header says {shape} ({expected} bytes), file holds {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def find_idx(source: str, prefix: str, kind: str) -> str:
    """Path of ``{prefix}-{kind}-idx?-ubyte[.gz]`` in ``source`` (kind: images or labels)."""
    dims = "3" if kind == "images" else "1"
    for name in (f"{prefix}-{kind}-idx{dims}-ubyte.gz", f"{prefix}-{kind}-idx{dims}-ubyte"):
        if os.path.isfile(os.path.join(source, name)):
            return os.path.join(source, name)
    raise FileNotFoundError(
        f"no {prefix}-{kind}-idx{dims}-ubyte[.gz] in {source!r} (apt-get install dataset-fashion-mnist, "
        "or pass --data)"
    )


def write_split(images: np.ndarray, labels: np.ndarray, folder: Path, shard_size: int, seed: int,
                overwrite: bool = False) -> dict[str, int]:
    """Write one split as shards plus the clip_benchmark side files (class names and templates in
    ``folder``'s parent, the set's root).

    Args:
        images: (N, 28, 28) uint8.
        labels: (N,) label indices into :data:`CLASSNAMES`.
        folder: the split's folder ``OUTPUT/{split}`` (created).
        shard_size: samples per shard.
        seed: caption-choice seed (the same seed gives byte-identical shards).
        overwrite: replace an earlier run's shards in ``folder`` (else a folder with shards is
            refused; no file this tool did not write is deleted, see ``prepare_output``).

    Returns:
        ``sizes.json``'s content: samples per shard file name.
    """
    if len(images) != len(labels):
        raise ValueError(f"{folder.name}: {len(images)} images but {len(labels)} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= len(CLASSNAMES)):
        raise ValueError(f"{folder.name}: labels outside 0..{len(CLASSNAMES) - 1}")
    prepare_output(str(folder), overwrite)
    rng = random.Random(seed)

    def samples():
        for i, (image, label) in enumerate(zip(images, labels)):
            buf = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(image), mode="L").save(buf, format="PNG")
            yield {
                "__key__": f"{folder.name}{i:06d}",
                "png": buf.getvalue(),
                "txt": rng.choice(CAPTION_TEMPLATES).format(c=CLASSNAMES[int(label)]),
                "cls": str(int(label)),
            }

    sizes = write_samples(samples(), str(folder / "%d.tar"), shard_size)
    write_clip_benchmark_files(str(folder.parent), folder.name, CLASSNAMES, ZERO_SHOT_TEMPLATES)
    return sizes


def convert(source: str, output: str, shard_size: int = 5000, limit: int | None = None, seed: int = 0,
            overwrite: bool = False) -> dict:
    """Convert both splits; returns ``{split: sizes}``.

    Args:
        source: folder of the four idx files.
        output: folder receiving ``train/`` and ``test/``.
        shard_size: samples per shard.
        limit: keep only the first ``limit`` samples of each split (quick runs).
        seed: caption seed (the test split uses ``seed + 1``).
        overwrite: replace the shards an earlier run wrote into ``output``.
    """
    out = {}
    for offset, (split, prefix) in enumerate(SPLITS.items()):
        images = read_idx(find_idx(source, prefix, "images"))
        labels = read_idx(find_idx(source, prefix, "labels"))
        if images.ndim != 3:
            raise ValueError(f"{prefix} images: expected (N, H, W), got shape {images.shape}")
        if limit is not None:
            images, labels = images[:limit], labels[:limit]
        out[split] = write_split(images, labels, Path(output) / split, shard_size, seed + offset, overwrite)
    return out


def main(argv: list[str] | None = None) -> int:
    """Convert the idx files in ``--data`` to shards in ``--output``; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_option(parser, "--data", "--source", default=DEFAULT_SOURCE,
               help=f"folder with the four idx files (default {DEFAULT_SOURCE})")
    parser.add_argument("--output", required=True, help="writes OUTPUT/train and OUTPUT/test")
    parser.add_argument(
        "--shard-size",
        type=int,
        default=5000,
        help="samples per shard (5000: 12 train and 2 test shards, enough for 2 workers in exact epochs)",
    )
    parser.add_argument("--limit", type=int, help="first N samples per split only")
    parser.add_argument("--seed", type=int, default=0, help="caption seed")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's shards in OUTPUT")
    args = parser.parse_args(argv)

    def write() -> None:
        result = convert(args.data, args.output, args.shard_size, args.limit, args.seed, args.overwrite)
        for split, sizes in result.items():
            print(f"{split}: {sum(sizes.values())} samples in {len(sizes)} shards -> {Path(args.output) / split}")

    return run("fashion_mnist", write)


if __name__ == "__main__":
    sys.exit(main())
