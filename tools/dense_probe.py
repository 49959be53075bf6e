"""Dense-feature probe: a linear classifier on a ViT's frozen patch tokens predicts each patch's
shape class on demo scenes; print mIoU and patch accuracy, write JSON.

    python tools/dense_probe.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --train-images 256 --test-images 128 --output-json dense.json

The scenes are the demo renderer's (:func:`mmssl.data.demo.dense_demo_set`), drawn in memory at the
model's input size with their per-pixel classes (background and the six shapes): training scenes
from ``--seed``, held-out scenes from ``--seed + 1``. Each patch is labelled with its majority class
(:func:`mmssl.evaluation.dense.patch_labels`), the model's patch tokens come from its
``forward_features`` (class token dropped), and a multinomial logistic regression (L-BFGS) fitted on
the training patches predicts the held-out ones. ``--ckpt`` is read as by ``tools/linear_probe.py``:
an mmssl Lightning checkpoint (MAE, CLIP / SigLIP / CoCa, ImageClassifier), a state dict with
``--model``, or a ``timm`` export folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import torch

from mmssl.data.demo import DENSE_CLASSES, dense_demo_set
from mmssl.evaluation.dense import (
    confusion_matrix,
    dense_probe,
    extract_patch_tokens,
    patch_labels,
    segmentation_scores,
    square_side,
)
from mmssl.evaluation.encoders import add_checkpoint_arguments, load_encoder
from mmssl.evaluation.offline import format_table
from mmssl.evaluation.report import write_json
from mmssl.tools._common import add_output_json, run


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--train-images", type=_positive, default=256, help="demo scenes to fit the probe on")
    p.add_argument("--test-images", type=_positive, default=128, help="held-out demo scenes to score it on")
    p.add_argument("--seed", type=int, default=0, help="seed of the training scenes; the held-out ones use seed + 1")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="L2 penalty of the logistic regression")
    p.add_argument("--max-iter", type=_positive, default=300, help="L-BFGS iterations")
    p.add_argument("--batch-size", type=_positive, default=64, help="images per forward")
    add_output_json(p)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Print the dense-probe figures (and write ``--output-json``); the exit status."""
    args = parse_args(argv)
    return run("dense_probe", lambda: _report(args))


def _report(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    model = load_encoder(args.ckpt, args.model, args.model_kwargs, args.model_class, args.ema)
    name = type(model).__name__
    if not hasattr(model, "forward_features"):
        raise ValueError(f"{name} gives no patch tokens (no forward_features): the dense probe needs a ViT image "
                         "tower's tokens (an mmssl checkpoint, a timm model or folder)")
    side = square_side(model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    sets = {}
    for split, count, seed in (("train", args.train_images, args.seed), ("test", args.test_images, args.seed + 1)):
        images, masks = dense_demo_set(count, side, seed)
        tokens = extract_patch_tokens(model, torch.from_numpy(images), model.image_mean, model.image_std,
                                      args.batch_size, device)  # (N, g, g, D)
        grid = tokens.shape[1]
        if side % grid:
            raise ValueError(f"{name}'s {grid} x {grid} patch grid does not tile its {side}-pixel images")
        sets[split] = (tokens, patch_labels(torch.from_numpy(masks), side // grid, len(DENSE_CLASSES)))
    (train_tokens, train_labels), (test_tokens, test_labels) = sets["train"], sets["test"]
    scores = dense_probe(train_tokens, train_labels, test_tokens, test_labels, len(DENSE_CLASSES),
                         list(DENSE_CLASSES), args.weight_decay, args.max_iter)
    # What a probe that learnt nothing scores: every held-out patch called the training set's most frequent class.
    majority = torch.full_like(test_labels, int(torch.bincount(train_labels.reshape(-1)).argmax()))
    baseline = segmentation_scores(confusion_matrix(majority, test_labels, len(DENSE_CLASSES)))
    report = {
        "checkpoint": args.ckpt, "model": args.model or name, "image_size": side, "patch_size": side // grid,
        "grid": grid, "num_train_images": args.train_images, "num_test_images": args.test_images, "seed": args.seed,
        **scores, "majority_miou": baseline["miou"], "majority_patch_accuracy": baseline["patch_accuracy"],
        "seconds": round(time.perf_counter() - start, 3),
    }
    rows = {k: v for k, v in report.items() if k not in ("per_class_iou", "confusion")}
    rows.update({f"iou {c}": "-" if v is None else v for c, v in report["per_class_iou"].items()})
    print(format_table(rows, f"dense probe of {args.ckpt}"))
    if args.output_json:
        write_json(args.output_json, report)  # atomically: a kill leaves the previous results whole
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    sys.exit(main())
