"""Zero-shot accuracy of a saved CLIP model on a labelled set; print a table, write JSON.

    python tools/zero_shot.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --data ~/.cache/mmssl/demo/val --output-json results.json

The set is a clip_benchmark ``wds/`` folder (``DIR/{split}``, or ``DIR`` for its ``test`` split)
or a folder or pattern of shards with ``cls``, with ``classnames.txt`` (one name per line, in label
order; a blank line or a repeated name is refused), or class folders (named after their sorted
folders when there is no ``classnames.txt``). Samples with a bad ``cls`` or an image above
``max_image_pixels`` are skipped, named and counted (``skipped``). Prompts come
from ``zeroshot_classification_templates.txt`` (beside the shards, else at the clip_benchmark
root), ``--templates``, or CLIP's 80 ImageNet templates. ``--ckpt`` takes an mmssl CLIP
Lightning checkpoint, an open_clip state dict with ``--model NAME-or-json``, or a CLIP export
folder (``tools/export.py --format open_clip_hf`` or ``hf``); an image-only model (MAE, a
fine-tuned ImageClassifier, a timm folder) is refused.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_encoder
from mmssl.evaluation.offline import check_data, emit_report, zero_shot_report
from mmssl.tools._common import add_loader_arguments, add_output_json, run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p, "open_clip model name or .json config", model_kwargs=False)
    p.add_argument(
        "--data",
        required=True,
        help="labelled set: clip_benchmark DIR or DIR/SPLIT, shard folder/pattern, or image folder",
    )
    p.add_argument("--classnames", help="class-names file (default: classnames.txt beside the data)")
    p.add_argument("--templates", help="templates file (default: beside the data, else the 80 OpenAI ones)")
    add_loader_arguments(p)
    add_output_json(p)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """Print the zero-shot table (and write ``--output-json``); the exit status."""
    args = parse_args(argv)
    return run("zero_shot", lambda: _report(args))


def _report(args: argparse.Namespace) -> None:
    check_data(args.data)  # before the model loads
    model = load_encoder(args.ckpt, args.model, None, args.model_class, args.ema)
    if not hasattr(model, "encode_text"):  # a user's wrong file, not a bug: one line naming it
        raise ValueError(f"{args.ckpt}: {type(model).__name__} has no text tower: zero-shot needs a CLIP checkpoint")
    report = zero_shot_report(model, args.data, args.classnames, args.templates, args.batch_size, args.num_workers)
    report = {"checkpoint": args.ckpt, "model": args.model or type(model).__name__, "data": args.data, **report}
    emit_report(report, f"zero-shot of {args.ckpt}", args.output_json)


if __name__ == "__main__":
    sys.exit(main())
