"""An image-folder set of the demo's scenes labelled by shape alone: ``OUTPUT/{train,test}/SHAPE/*.png``.

    python benchmarks/shapes_folder.py --output data/shapes --train 3000 --test 600

The third layout of labelled sets (torchvision ``ImageFolder``: class names from the folder names)
beside the demo's clip_benchmark shards: 6 classes (circle, square, triangle, star, cross,
diamond), any colour, size, position and background, drawn by the demo's own ``draw_scene``
(seeded). Each split also holds ``zeroshot_classification_templates.txt`` for zero-shot.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Optional

from mmssl.data.demo import SHAPES, draw_scene

TEMPLATES = ("a photo of a {c}.", "a {c}.", "a picture of a {c} shape.")


def write_split(folder: Path, count: int, seed: int, image_size: int) -> None:
    """``count`` scenes as ``folder/SHAPE/NNNNN.png``."""
    rng = random.Random(seed)
    for shape in SHAPES:
        (folder / shape).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        image, attrs = draw_scene(rng, image_size)
        image.save(folder / attrs["shape"] / f"{i:05d}.png")
    (folder / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="folder to write train/ and test/ into")
    p.add_argument("--train", type=int, default=3000, help="training images")
    p.add_argument("--test", type=int, default=600, help="test images")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        print(f"shapes_folder: {out} is not empty", file=sys.stderr)
        return 1
    write_split(out / "train", args.train, args.seed, args.image_size)
    write_split(out / "test", args.test, args.seed + 1, args.image_size)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
