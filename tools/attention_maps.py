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
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_model
from mmssl.visualize.attention import attention_maps
from mmssl.visualize.figures import overlay_grid, save_png
from mmssl.visualize.inputs import load_images


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--images", nargs="+", required=True, help="image files")
    p.add_argument("--output", required=True, help="folder for the PNGs")
    p.add_argument("--dpi", type=int, default=100, help="PNG resolution (panels are 1.8 inches wide)")
    p.add_argument("--head-fusion", choices=("mean", "max", "min"), default="mean",
                   help="how the rollout combines heads (the paper: mean)")
    return p.parse_args(argv)


def output_names(paths: list[str], suffix: str) -> list[str]:
    """One output file name per input image: its stem plus ``suffix``, or, where two inputs share
    a stem (``a/x.jpg``, ``b/x.jpg``), its path relative to the inputs' common folder.

    Raises:
        ValueError: two inputs would still write one file (``x.jpg`` and ``x.png``), naming both.
    """
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(stems)) == len(stems):
        return [stem + suffix for stem in stems]
    absolute = [os.path.abspath(p) for p in paths]
    common = os.path.commonpath([os.path.dirname(a) for a in absolute])
    names = [os.path.splitext(os.path.relpath(a, common))[0] + suffix for a in absolute]
    first: dict[str, str] = {}
    for path, name in zip(paths, names):
        if name in first:
            raise ValueError(f"--images {first[name]!r} and {path!r} would both be written to {name!r}: "
                             "rename one, or run them separately")
        first[name] = path
    return names


def main(argv: Optional[list[str]] = None) -> list[str]:
    args = parse_args(argv)
    names = output_names(args.images, "_attention.png")  # before anything is loaded or written
    model = load_model(args.ckpt, args.model, args.model_kwargs, args.model_class)
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
    return written


if __name__ == "__main__":
    main()
