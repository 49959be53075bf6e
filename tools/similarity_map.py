"""Patch-to-text similarity of a CLIP over each input image (MaskCLIP-style dense features):
every patch token through the image tower's final norm and projection, cosine with each query.

    python tools/similarity_map.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --image docs/visualize/inputs/star.jpg --text "a star" --text "a circle" --output sim/

One PNG per image, one panel per query; each panel is scaled to its own range (its titles give
the cosine range). ``--ckpt`` takes an mmssl CLIP checkpoint, or an open_clip state dict with
``--model NAME-or-json``; an image-only model (MAE, a fine-tuned ImageClassifier) is refused.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_model
from mmssl.visualize.figures import overlay_grid, save_png
from mmssl.visualize.inputs import load_images
from mmssl.visualize.similarity import similarity_maps


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p, "open_clip model name or .json config", model_kwargs=False)
    p.add_argument("--image", nargs="+", required=True, help="image files")
    p.add_argument("--text", action="append", required=True, help="a query; repeat for more")
    p.add_argument("--output", required=True, help="folder for the PNGs")
    p.add_argument("--dpi", type=int, default=100, help="PNG resolution (panels are 1.8 inches wide)")
    p.add_argument("--value-path", action="store_true",
                   help="MaskCLIP's last layer: each token keeps its own value (no query-key mixing)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[str]:
    args = parse_args(argv)
    model = load_model(args.ckpt, args.model, None, args.model_class)
    images, views = load_images(args.image, model)
    maps = similarity_maps(model, images, args.text, args.value_path).numpy()  # (B, Q, h, w)
    os.makedirs(args.output, exist_ok=True)
    written = []
    for i, path in enumerate(args.image):
        titles = [f'"{t}"\ncos {m.min():.2f}..{m.max():.2f}' for t, m in zip(args.text, maps[i])]
        figure = overlay_grid(views[i], list(maps[i]), titles, f"{os.path.basename(path)}: patch-text similarity"
                              + (" (value path)" if args.value_path else ""))
        stem = os.path.splitext(os.path.basename(path))[0]
        written.append(save_png(figure, os.path.join(args.output, f"{stem}_similarity.png"), args.dpi))
        print(written[-1])
    return written


if __name__ == "__main__":
    main()
