"""Patch-to-text similarity of a CLIP over each input image (MaskCLIP-style dense features):
every patch token through the image tower's final norm and projection, cosine with each query.

    python tools/similarity_map.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --images docs/visualize/inputs/star.jpg --text "a star" --text "a circle" --output sim/

One PNG per image, one panel per query; each panel is scaled to its own range (its titles give
the cosine range). ``--ckpt`` takes an mmssl CLIP checkpoint, or an open_clip state dict with
``--model NAME-or-json``; an image-only model (MAE, a fine-tuned ImageClassifier) is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_model
from mmssl.tools._common import add_images, check_images, output_names, run
from mmssl.visualize.figures import overlay_grid, save_png
from mmssl.visualize.inputs import load_images
from mmssl.visualize.similarity import similarity_maps


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p, "open_clip model name or .json config", model_kwargs=False)
    add_images(p, "--image")
    p.add_argument("--text", action="append", required=True, help="a query; repeat for more")
    p.add_argument("--output", required=True, help="folder for the PNGs")
    p.add_argument("--dpi", type=int, default=100, help="PNG resolution (panels are 1.8 inches wide)")
    p.add_argument("--value-path", action="store_true",
                   help="MaskCLIP's last layer: each token keeps its own value (no query-key mixing)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Write one PNG per image to ``--output``; the exit status (prints each PNG's path)."""
    args = parse_args(argv)
    return run("similarity_map", lambda: _write(args))


def _write(args: argparse.Namespace) -> None:
    names = output_names(args.images, "_similarity.png")  # before anything is loaded or written
    check_images(args.images)
    model = load_model(args.ckpt, args.model, None, args.model_class, args.ema)
    if not hasattr(model, "encode_text"):  # a user's wrong file, not a bug: one line naming it
        raise ValueError(f"{args.ckpt}: {type(model).__name__} is not a CLIP: patch-text similarity needs a CLIP "
                         "checkpoint or an open_clip file")
    images, views = load_images(args.images, model)
    maps = similarity_maps(model, images, args.text, args.value_path).numpy()  # (B, Q, h, w)
    os.makedirs(args.output, exist_ok=True)
    for i, path in enumerate(args.images):
        titles = [f'"{t}"\ncos {m.min():.2f}..{m.max():.2f}' for t, m in zip(args.text, maps[i])]
        figure = overlay_grid(views[i], list(maps[i]), titles, f"{os.path.basename(path)}: patch-text similarity"
                              + (" (value path)" if args.value_path else ""))
        out = os.path.join(args.output, names[i])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        print(save_png(figure, out, args.dpi))


if __name__ == "__main__":
    sys.exit(main())
