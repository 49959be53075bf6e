"""Linear probes on Fashion-MNIST: an MAE encoder, the same encoder randomly initialised, raw pixels.

    python benchmarks/fashion_mnist_probe.py --ckpt runs/.../last.ckpt --data data/fashion_mnist \
        --train-samples 10000 --output-json probe.json

The probe is ``mmssl.evaluation.linear.fit_logistic`` (multinomial logistic regression by
full-batch L-BFGS on standardised frozen features, as ``tools/linear_probe.py``); this script adds
what that tool has no notion of: the same architecture randomly initialised, and raw pixels.
Features: the final-norm cls token (MAE paper) and the mean of the patch tokens, both from one
unmasked forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.linear import fit_logistic, topk_accuracy


@torch.no_grad()
def extract(model, folder: str, limit: int, batch_size: int = 500) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Features of the first ``limit`` samples of ``folder``: ``cls``, ``avg`` (model) or ``pixels``.

    Args:
        model: an MAE module (``forward_features``), or ``None`` for raw pixels.
        folder: labelled shards.
        limit: samples to read.
        batch_size: images per forward pass.

    Returns:
        ``({name: (N, D)}, labels (N,))``.
    """
    size = model.image_size if model is not None else 28
    mean = model.image_mean if model is not None else (0.0, 0.0, 0.0)
    std = model.image_std if model is not None else (1.0, 1.0, 1.0)
    feats: dict[str, list[torch.Tensor]] = {}
    labels, seen = [], 0
    for batch in labeled_loader(folder, eval_transform(size, mean, std), batch_size, image_key="png"):
        images = batch["image"][: limit - seen]
        if model is None:
            out = {"pixels": images[:, 0].flatten(1)}  # grey images: one channel holds them all
        else:
            tokens = model.forward_features(images)  # (B, 1+L, D)
            out = {"cls": tokens[:, 0], "avg": tokens[:, 1:].mean(dim=1)}
        for k, v in out.items():
            feats.setdefault(k, []).append(v)
        labels.append(batch["label"][: len(images)])
        seen += len(images)
        if seen >= limit:
            break
    return {k: torch.cat(v) for k, v in feats.items()}, torch.cat(labels)


def logistic_regression(x_train, y_train, x_test, y_test) -> float:
    """Top-1 on the test set of the package's L-BFGS probe (``mmssl.evaluation.linear``)."""
    classifier = fit_logistic(x_train, y_train, int(y_train.max()) + 1)
    with torch.no_grad():
        return topk_accuracy(classifier(x_test), y_test, ks=(1,))["top1"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="MAE Lightning checkpoint")
    parser.add_argument("--data", required=True, help="folder with train/ and test/ (tools/fashion_mnist.py)")
    parser.add_argument("--train-samples", type=int, default=10000)
    parser.add_argument("--test-samples", type=int, default=10000)
    parser.add_argument("--only", nargs="+", choices=("pixels", "random_init", "mae"),
                        default=("pixels", "random_init", "mae"), help="which feature sets to probe")
    parser.add_argument("--ema", action="store_true",
                        help="probe the checkpoint's EMA weights (mmssl.callbacks.EMA) instead of the raw ones")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    from mmssl.checkpoints.load import load_lightning
    from mmssl.models.mae import MAE

    # The raw weights unless --ema, as every tool reads them (mmssl.checkpoints.read.lightning_weights);
    # MAE.load_from_checkpoint would take the average of a checkpoint trained with the EMA callback.
    trained = load_lightning(args.ckpt, "MAE", ema=args.ema).eval()
    torch.manual_seed(0)
    random_init = MAE(**{k: v for k, v in trained.hparams.items() if k != "init_encoder"}).eval()
    results = {}
    for name, model in (("pixels", None), ("random_init", random_init), ("mae", trained)):
        if name not in args.only:
            continue
        t0 = time.time()
        train, y_train = extract(model, os.path.join(args.data, "train"), args.train_samples)
        test, y_test = extract(model, os.path.join(args.data, "test"), args.test_samples)
        for kind in train:
            top1 = logistic_regression(train[kind], y_train, test[kind], y_test)
            results[f"{name}/{kind}"] = top1
            print(f"{name:<12} {kind:<7} top1 {top1:.4f}  ({time.time() - t0:.0f}s)", flush=True)
    results.update(train_samples=len(y_train), test_samples=len(y_test), ckpt=args.ckpt, ema=args.ema)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
