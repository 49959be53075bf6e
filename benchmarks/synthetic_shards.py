"""Benchmark shards from generated pictures and captions with web-like lengths (tools/make_shards.py's writer).

    python benchmarks/synthetic_shards.py --output /tmp/bench256 --size 256 --count 2048 [--shard-size 512]

Images: JPEG at quality 95 (img2dataset's default encode quality), ``size`` pixels square (img2dataset's
``resize_mode=center_crop`` output), a smooth random field with a fine texture so that files weigh
what photos of that size weigh (~30 KB at 256 px, ~100 KB at 512 px) and take a photo's decode
time. Captions: words from a fixed vocabulary, a log-normal number of them, tuned so that the
open_clip BPE length (without start/end tokens) has a median of ~11 tokens and a long tail past 77,
as LAION/CC captions do (LAION-400M's median is ~10-12 tokens).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Optional

import numpy as np
from PIL import Image

from mmssl.data.folders import shuffled
from mmssl.data.shards import write_shards

_WORDS = (
    "a photo of the with and in on for at by from red blue green black white old new small large "
    "dog cat car house tree man woman child people street city beach mountain river sky sunset "
    "table chair kitchen room garden flower food plate coffee cup book phone computer shirt dress "
    "shoes bag watch ring logo design poster vector illustration drawing painting art print "
    "wedding party family portrait close-up view background texture pattern vintage modern "
    "stock image high quality free download wallpaper summer winter spring autumn night light "
    "wooden metal glass stone leather cotton silk gold silver pink yellow orange purple brown "
    "2019 2020 2021 set pack collection sale women's men's kids home decor outdoor indoor travel"
).split()


def caption(rng: np.random.Generator) -> str:
    """One caption: a log-normal word count (median 10 words, ~11 BPE tokens), capped at 100 words."""
    words = min(100, max(1, int(round(math.exp(rng.normal(math.log(10.0), 0.8))))))
    text = " ".join(rng.choice(_WORDS, size=words))
    return text[0].upper() + text[1:] + ("." if rng.random() < 0.3 else "")


def picture(rng: np.random.Generator, size: int) -> Image.Image:
    """A smooth random colour field (bicubic from 8x8) plus a fine grain: photo-like JPEG cost."""
    coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
    grain = rng.normal(0.0, 6.0, (size, size, 3))
    return Image.fromarray(np.clip(np.asarray(coarse, dtype=np.float32) + grain, 0, 255).astype(np.uint8))


def write_bench_shards(output: str, size: int, count: int, shard_size: int = 512, seed: int = 0,
                       workdir: Optional[str] = None) -> str:
    """Write ``count`` generated samples as shards into ``output`` (with ``sizes.json``).

    Args:
        output: shard folder.
        size: image side in pixels.
        count: samples.
        shard_size: samples per shard.
        seed: seed of pictures and captions.
        workdir: where the JPEGs go first (a temporary folder by default).

    Returns:
        ``output``.
    """
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        rows = []
        for i in range(count):
            path = os.path.join(tmp, f"{i:06d}.jpg")
            picture(rng, size).save(path, format="JPEG", quality=95)
            rows.append((path, caption(rng), None))
        # What `tools/make_shards.py --table` does with such a table, in this process (tests time it).
        write_shards(shuffled(rows, seed), output, shard_size, total=count)
    return output


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="shard folder")
    parser.add_argument("--size", type=int, default=256, help="image side (pixels)")
    parser.add_argument("--count", type=int, default=2048, help="samples")
    parser.add_argument("--shard-size", type=int, default=512, help="samples per shard")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_bench_shards(args.output, args.size, args.count, args.shard_size, args.seed)
    print(f"wrote {args.count} samples of {args.size} px to {args.output}")


if __name__ == "__main__":
    main()
