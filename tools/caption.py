"""Captions from a CoCa checkpoint for image files or a labelled set; on a set with class names,
the share of captions that name the image's class.

    python tools/caption.py --ckpt runs/demo_coca/version_0/checkpoints/last.ckpt \
        --images a.jpg b.jpg
    python tools/caption.py --ckpt runs/demo_coca/version_0/checkpoints/last.ckpt \
        --data ~/.cache/mmssl/demo/val --output captions.jsonl --output-json captions.json

``--generation-type beam_search`` (default; ``--num-beams``, ``--length-penalty``) keeps the most
likely captions; ``top_p`` (``--top-p``) and ``top_k`` (``--top-k``) sample with open_clip's
``CoCa.generate`` (``--temperature``, ``--repetition-penalty``). ``--seq-len`` (default: the
model's text context) / ``--min-seq-len`` bound the caption in tokens, start and end included.
``--output`` writes one JSON line per image (``image`` or ``index``, ``caption``, and on a set
``label``, ``class``, ``names_class``);
``--output-json`` the summary (``names_class``: the share of captions naming the class as a phrase,
on the demo set a caption naming both colour and shape correctly). ``--seed`` fixes sampling.
``--ema`` captions with a checkpoint's EMA of the weights (a checkpoint without one is refused).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from mmssl.data.label_files import read_classnames
from mmssl.data.labeled import labeled_loader
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.captions import generate_captions, names_class
from mmssl.evaluation.encoders import add_checkpoint_arguments, load_model
from mmssl.evaluation.offline import emit_report
from mmssl.models.generation import GENERATION_TYPES
from mmssl.tools._common import add_loader_arguments, add_option, add_output_json, check_images, run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p, "open_clip CoCa model name or .json config", model_kwargs=False)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", nargs="+", metavar="IMAGE", help="image files (one or many)")
    source.add_argument(
        "--data", help="labelled set: clip_benchmark DIR or DIR/SPLIT, shard folder/pattern, or image folder"
    )
    p.add_argument("--classnames", help="class-names file (default: classnames.txt beside --data)")
    p.add_argument("--limit", type=int, help="caption only the first N samples of --data")
    add_option(p, "--output", help="write one JSON line per image here")
    add_output_json(p, help="write the summary here as JSON")
    g = p.add_argument_group("generation")
    g.add_argument("--generation-type", choices=GENERATION_TYPES, default="beam_search")
    g.add_argument("--seq-len", type=int, help="longest caption in tokens, start and end included "
                                               "(default: the model's text context)")
    g.add_argument("--min-seq-len", type=int, default=5, help="no end-of-text before this many tokens")
    g.add_argument("--num-beams", type=int, default=6, help="beam_search: beams per image")
    g.add_argument("--length-penalty", type=float, default=1.0, help="beam_search: score = log p / length ** this")
    g.add_argument("--top-p", type=float, default=0.9, help="top_p: keep the smallest set of tokens of this mass")
    g.add_argument("--top-k", type=int, default=5, help="top_k: keep this many most likely tokens")
    g.add_argument("--temperature", type=float, default=1.0, help="top_p / top_k: softmax temperature")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="top_p / top_k: transformers' penalty")
    g.add_argument("--seed", type=int, default=0, help="top_p / top_k: sampling seed")
    add_loader_arguments(p, batch_size=32)
    args = p.parse_args(argv)
    if args.generation_type != "beam_search":  # checked here: sampling divides the logits by the temperature
        if not args.temperature > 0:
            p.error(f"--temperature {args.temperature:g}: sampling needs a temperature above 0 (the logits are "
                    "divided by it); for the most likely caption use --generation-type beam_search")
        if args.generation_type == "top_k" and args.top_k < 1:
            p.error(f"--top-k {args.top_k}: keep at least 1 token")
        if args.generation_type == "top_p" and not 0 < args.top_p <= 1:
            p.error(f"--top-p {args.top_p:g}: a probability mass in (0, 1]")
    return args


def generation_params(args: argparse.Namespace) -> dict:
    """The chosen generation type's arguments of :func:`mmssl.evaluation.captions.generate_captions`."""
    params = {"generation_type": args.generation_type, "seq_len": args.seq_len, "min_seq_len": args.min_seq_len}
    if args.generation_type == "beam_search":
        return {**params, "num_beams": args.num_beams, "length_penalty": args.length_penalty}
    sampling = {"temperature": args.temperature, "repetition_penalty": args.repetition_penalty}
    key = "top_p" if args.generation_type == "top_p" else "top_k"
    return {**params, **sampling, key: getattr(args, key)}


def main(argv: Optional[list[str]] = None) -> int:
    """Write the captions (and ``--output-json``); the exit status."""
    args = parse_args(argv)
    return run("caption", lambda: _caption(args))


def _caption(args: argparse.Namespace) -> None:
    if args.seq_len is not None and args.seq_len <= args.min_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} must exceed --min-seq-len {args.min_seq_len}")
    if args.images:
        check_images(args.images)  # before the model is read
    model = load_model(args.ckpt, args.model, None, args.model_class, args.ema)
    if not hasattr(model, "generation_ids"):  # a user's wrong file: one line naming it
        raise ValueError(f"{args.ckpt}: {type(model).__name__} has no text decoder: captions need a CoCa checkpoint")
    if args.seq_len is None:  # the longest caption the model was trained on: its text context
        args.seq_len = int(model.model.context_length)
        if args.seq_len <= args.min_seq_len:
            raise ValueError(f"{args.ckpt}: the text context ({args.seq_len} tokens) must exceed --min-seq-len "
                             f"{args.min_seq_len}")
    params = generation_params(args)
    torch.manual_seed(args.seed)
    rows = _from_images(model, args, params) if args.images else _from_data(model, args, params)
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    report = {"checkpoint": args.ckpt, "ema": args.ema, **params, "num_samples": len(rows)}
    if args.data:
        report["names_class"] = sum(r["names_class"] for r in rows) / max(1, len(rows))
    else:
        for row in rows:
            print(f"{row['image']}: {row['caption']}")
    emit_report(report, f"captions of {args.ckpt}", args.output_json)


def _from_images(model: torch.nn.Module, args: argparse.Namespace, params: dict) -> list[dict]:
    from mmssl.visualize.inputs import load_images

    rows = []
    for start in range(0, len(args.images), args.batch_size):
        paths = args.images[start:start + args.batch_size]
        images, _ = load_images(paths, model)
        rows += [{"image": p, "caption": c} for p, c in zip(paths, generate_captions(model, images, **params))]
    return rows


def _from_data(model: torch.nn.Module, args: argparse.Namespace, params: dict) -> list[dict]:
    names = read_classnames(args.data, args.classnames)
    transform = eval_transform(model.image_size, model.image_mean, model.image_std)
    rows: list[dict] = []
    for batch in labeled_loader(args.data, transform, args.batch_size, args.num_workers, limit=args.limit):
        if len(batch["label"]) == 0:
            continue
        captions = generate_captions(model, batch["image"], **params)
        for index, label, text in zip(batch["index"].tolist(), batch["label"].tolist(), captions):
            name = names[label] if 0 <= label < len(names) else None
            rows.append({"index": index, "label": label, "class": name, "caption": text,
                         "names_class": name is not None and names_class(text, name)})
    return rows


if __name__ == "__main__":
    sys.exit(main())
