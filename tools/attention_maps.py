"""Attention maps of a ViT image encoder: the cls token's last-layer attention per head and the
attention rollout over all layers (Abnar & Zuidema 2020), over each input image; one PNG each.

    python tools/attention_maps.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --images docs/visualize/inputs/*.jpg --output attention/

``--ckpt`` takes an mmssl MAE, CLIP or fine-tuned ImageClassifier checkpoint, or an exported
state dict with ``--model``:
a timm ViT name (``--model-kwargs '{"img_size": 32, "patch_size": 4}'``) or an open_clip
name / JSON config. Every map is scaled to its own range; the titles give each map's maximum,
as a share of the cls token's attention to the patches (uniform: 1 / patches).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_model
from mmssl.tools._common import add_images, check_images, output_names, run
from mmssl.visualize.attention import attention_maps
from mmssl.visualize.figures import overlay_grid, save_png
from mmssl.visualize.inputs import load_images


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    add_images(p)
    p.add_argument("--output", required=True, help="folder for the PNGs")
    p.add_argument("--dpi", type=int, default=100, help="PNG resolution (panels are 1.8 inches wide)")
    p.add_argument("--head-fusion", choices=("mean", "max", "min"), default="mean",
                   help="how the rollout combines heads (the paper: mean)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Write one PNG per image to ``--output``; the exit status (prints each PNG's path)."""
    args = parse_args(argv)
    return run("attention_maps", lambda: _write(args))


def _write(args: argparse.Namespace) -> None:
    names = output_names(args.images, "_attention.png")  # before anything is loaded or written
    check_images(args.images)
    model = load_model(args.ckpt, args.model, args.model_kwargs, args.model_class, args.ema)
    images, views = load_images(args.images, model)
    maps = attention_maps(model, images, args.head_fusion)
    os.makedirs(args.output, exist_ok=True)
    written = []
    for i, path in enumerate(args.images):
        heads, rollout = maps["heads"][i].numpy(), maps["rollout"][i].numpy()
        panels = [rollout, *heads]
        titles = [f"rollout (max {rollout.max():.2f})",
                  *(f"head {h} (max {m.max():.2f})" for h, m in enumerate(heads, start=1))]
        figure = overlay_grid(views[i], panels, titles, f"{os.path.basename(path)}: cls attention, "
                              f"{heads.shape[1]}x{heads.shape[2]} patches")
        out = os.path.join(args.output, names[i])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        written.append(save_png(figure, out, args.dpi))
        print(written[-1])


if __name__ == "__main__":
    sys.exit(main())
