"""Masked colour and shape words of held-out demo captions, with the true image and a blank one.

    python tools/masked_words.py --ckpt runs/demo_m3ae/version_0/checkpoints/last.ckpt \\
        --data ~/.cache/mmssl/demo/val --output-json masked_words.json

The gap between the two top-1 figures is what the model read from the image
(:mod:`mmssl.evaluation.masked_words`). ``--ckpt`` takes an M3AE or CLIP + MLM Lightning checkpoint;
``--data`` image-text shards (``txt`` captions naming the demo's colours and shapes).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from mmssl.data.heldout import read_heldout
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.encoders import add_checkpoint_arguments, load_model
from mmssl.evaluation.masked_words import masked_word_accuracy
from mmssl.evaluation.offline import check_data, emit_report
from mmssl.tools._common import add_loader_arguments, add_output_json, run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p, "model name (unused: M3AE and CLIP + MLM checkpoints name their class)",
                             model_kwargs=False)
    p.add_argument("--data", required=True, help="held-out image-text shards (clip_benchmark split, folder, pattern)")
    p.add_argument("--limit", type=int, default=1000, help="captions read from the start of --data")
    add_loader_arguments(p, batch_size=64, batch_help="captions per forward")
    add_output_json(p)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Print the table (and write ``--output-json``); the exit status."""
    args = parse_args(argv)
    return run("masked_words", lambda: _report(args))


def _report(args: argparse.Namespace) -> None:
    check_data(args.data)  # before the model loads
    model = load_model(args.ckpt, args.model, None, args.model_class, args.ema)
    if not hasattr(model, "predict_masked_tokens"):
        raise ValueError(f"{args.ckpt}: {type(model).__name__} predicts no masked words: an M3AE or CLIP + MLM "
                         "checkpoint is needed")
    data = os.path.expanduser(args.data)
    held = read_heldout(data, eval_transform(model.image_size, model.image_mean, model.image_std), model.tokenizer,
                        limit=args.limit)
    if held.tokens is None or len(held) == 0:
        raise ValueError(f"--data: {data} holds no readable image-caption pair")
    report = masked_word_accuracy(model, held.images, held.tokens, batch_size=args.batch_size)
    flat = {"checkpoint": args.ckpt, "data": data, "samples": len(held), "skipped": held.skipped}
    for name, figures in report.items():
        flat.update({f"{name}/{key}": value for key, value in figures.items()})
    emit_report(flat, f"masked words of {args.ckpt}", args.output_json)


if __name__ == "__main__":
    sys.exit(main())
