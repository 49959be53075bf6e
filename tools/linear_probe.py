"""Linear-probe (and k-NN) a saved model on labelled sets; print a table, write JSON.

    python tools/linear_probe.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --train-data ~/.cache/mmssl/demo/train --val-data ~/.cache/mmssl/demo/val \
        --all-layers --output-json results.json

``--ckpt`` takes an mmssl Lightning checkpoint (read as weights only; built as mmssl's MAE, CLIP
or fine-tuned ImageClassifier, whichever the checkpoint or the run's config.yaml names; for a
fine-tuned classifier ``--feature embedding`` is what its head reads), or an exported state dict with
``--model``: a timm name (``vit_base_patch16_224``, extra ``--model-kwargs '{"img_size": 32}'``)
or an open_clip name / JSON config, or an export folder (``tools/export.py``): a ``timm`` folder
probes as its checkpoint, an ``open_clip_hf`` or ``hf`` CLIP folder with ``--feature embedding``
(it gives no tokens).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_encoder
from mmssl.evaluation.offline import check_data, emit_report, linear_probe_report
from mmssl.tools._common import add_loader_arguments, add_output_json, run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument(
        "--train-data",
        required=True,
        help="labelled train set: clip_benchmark DIR/SPLIT, shard folder/pattern, or image folder",
    )
    p.add_argument("--val-data", required=True, help="labelled evaluation set")
    p.add_argument("--feature", choices=("cls", "avg", "embedding"), default="cls")
    p.add_argument("--method", choices=("lbfgs", "mae"), default="lbfgs",
                   help="lbfgs: exact logistic regression (fast); mae: MAE paper BatchNorm + LARS recipe")
    layers = p.add_mutually_exclusive_group()
    layers.add_argument("--all-layers", action="store_true",
                        help="probe every block too (--layers all|none: the old spelling, deprecated, still accepted)")
    layers.add_argument("--layers", choices=("all", "none"), help=argparse.SUPPRESS)
    p.add_argument("--weight-decay", type=float, default=1e-4, help="lbfgs L2 penalty")
    p.add_argument("--epochs", type=int, default=90, help="mae recipe epochs")
    p.add_argument("--knn-k", type=int, default=20, help="k of the weighted k-NN (0: skip)")
    p.add_argument("--knn-temperature", type=float, default=0.07)
    add_loader_arguments(p)
    add_output_json(p)
    args = p.parse_args(argv)
    args.all_layers = args.all_layers or args.layers == "all"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Print the probe table (and write ``--output-json``); the exit status."""
    args = parse_args(argv)
    return run("linear_probe", lambda: _report(args))


def _report(args: argparse.Namespace) -> None:
    check_data(args.train_data, "--train-data")  # before the model loads
    check_data(args.val_data, "--val-data")
    model = load_encoder(args.ckpt, args.model, args.model_kwargs, args.model_class, args.ema)
    fit_kwargs = {"weight_decay": args.weight_decay} if args.method == "lbfgs" else {"epochs": args.epochs}
    report = linear_probe_report(
        model, args.train_data, args.val_data, args.feature, args.method, args.all_layers,
        args.knn_k, args.knn_temperature, args.batch_size, args.num_workers, fit_kwargs=fit_kwargs,
    )
    report = {"checkpoint": args.ckpt, "model": args.model or type(model).__name__,
              "train_data": args.train_data, "val_data": args.val_data, **report}
    emit_report(report, f"linear probe of {args.ckpt}", args.output_json)


if __name__ == "__main__":
    sys.exit(main())
