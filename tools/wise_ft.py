"""WiSE-FT (Wortsman et al. 2022): mix a start and a fine-tuned checkpoint, score every mix, plot the
trade-off and export the alpha you choose.

    python tools/wise_ft.py --start runs/demo_clip/version_0/checkpoints/last.ckpt \
        --end runs/demo_clip_flyp/version_0/checkpoints/last.ckpt \
        --target ~/.cache/mmssl/demo/val --keep data/fashion_mnist/test \
        --output-json wise_ft.json --plot wise_ft.png
    python tools/wise_ft.py --start START.ckpt --end END.ckpt --export-alpha 0.5 --output mixed.ckpt

Weights are mixed as ``(1 - alpha) start + alpha end`` (alpha 0: the start, 1: the fine-tuned end;
default 0, 0.1, ..., 1). Both files must be one architecture: another model class, model config,
key or shape is refused, naming the first. A CLIP scores zero-shot on every set (its
``classnames.txt`` and templates); an ImageClassifier scores its head's top-1; a CLIP start with an
ImageClassifier end (fine-tuned from it with ``model.zero_shot_head``) is compared as classifiers,
kept sets zero-shot through the start CLIP with the mix's encoder (mmssl/evaluation/wise_ft.py).
``--reference FILE`` scores another fine-tune of the same start once (the full fine-tune beside a
FLYP run, say): each mix's gain on the target is then also given as a share of the reference's
gain (``ref gain``), and the plot shows the reference as a star.
``--export-alpha A --output FILE`` writes the mix at A as a checkpoint of the end's kind, which every
tool and ``mmssl validate`` reads (``mmssl.checkpoints.load``). ``--ema`` mixes the checkpoints' EMA
of the weights (start, end and reference each must hold one) instead of their raw weights; a CLIP
start with a classifier end mixes raw weights only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch

from mmssl.checkpoints.interpolate import DEFAULT_ALPHAS, check_alphas
from mmssl.checkpoints.io import atomic_torch_save
from mmssl.evaluation.encoders import add_ema_argument
from mmssl.export.paths import check_output
from mmssl.tools._common import add_loader_arguments, add_output_json, run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", required=True, help="start checkpoint (alpha 0): the zero-shot / pretrained model")
    p.add_argument("--end", required=True, help="fine-tuned checkpoint (alpha 1), same architecture")
    p.add_argument(
        "--alphas", type=float, nargs="+", default=list(DEFAULT_ALPHAS), help="mixing coefficients in [0, 1]"
    )
    p.add_argument("--target", nargs="+", default=[], help="labelled set(s) the fine-tune is for")
    p.add_argument("--keep", nargs="+", default=[], help="labelled set(s) whose accuracy must be kept")
    p.add_argument("--reference", help="another fine-tune of the start (a full fine-tune, say): scored once, and each "
                   "mix's target gain given as a share of its gain")
    p.add_argument("--limit", type=int, help="score only the first N samples of each set")
    p.add_argument("--plot", help="write target against kept accuracy here (PNG)")
    p.add_argument("--export-alpha", type=float, help="write the mix at this alpha to --output")
    p.add_argument("--output", help="the checkpoint (.ckpt) --export-alpha writes")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to score")
    add_ema_argument(p)
    add_loader_arguments(p)
    add_output_json(p)
    args = p.parse_args(argv)
    if (args.export_alpha is None) != (args.output is None):
        p.error("--export-alpha and --output go together")
    if args.output is not None and args.output.lower().endswith(".safetensors"):
        # The mix is a Lightning checkpoint (weights, hyper-parameters, kind): torch.save's format,
        # which a .safetensors name would misstate to every loader that goes by the suffix.
        p.error(f"--output {args.output!r}: --export-alpha writes a Lightning checkpoint (torch.save), not "
                "safetensors: name a .ckpt file, then tools/export.py writes .safetensors for timm or open_clip")
    if args.export_alpha is None and not (args.target or args.keep):
        p.error("nothing to do: give --target / --keep sets to score, or --export-alpha with --output")
    if args.plot and not args.keep:
        p.error("--plot draws target against kept accuracy: give --keep sets")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Score the mixes (print a table, write ``--output-json`` / ``--plot``) and export; the exit status."""
    args = parse_args(argv)
    return run("wise_ft", lambda: _wise_ft(args))


def _wise_ft(args: argparse.Namespace) -> None:
    alphas = check_alphas(args.alphas)
    if args.export_alpha is not None:
        check_alphas([args.export_alpha])
        check_output(args.output, folder=False, overwrite=args.overwrite)
    if args.reference and not args.target:
        raise ValueError("--reference measures the mixes' target gain against it: give --target sets")
    for path in (args.start, args.end, *([args.reference] if args.reference else []), *args.target, *args.keep):
        if not os.path.exists(path):
            raise FileNotFoundError(f"no file or folder at {path!r}")
    from mmssl.evaluation.wise_ft import Pair, plot_wise_ft, wise_ft_curve  # builds models: after the checks

    pair = Pair(args.start, args.end, args.ema)
    if args.target or args.keep:
        report = wise_ft_curve(pair, alphas, args.target, args.keep, args.batch_size, args.num_workers, args.limit,
                               torch.device(args.device), reference=args.reference)
        _print(report)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(report, f, indent=2)
        if args.plot:
            plot_wise_ft(report, args.plot)
    if args.export_alpha is not None:
        atomic_torch_save(pair.checkpoint(args.export_alpha), args.output)
        print(f"wrote {args.output}: {pair.kind.name}, alpha {args.export_alpha:g}")


def _print(report: dict) -> None:
    sets = [*report["targets"], *report["keep"]]
    ref = report.get("reference")
    extras = ["kept", "gain", *(["ref gain"] if ref else [])]
    print("alpha  " + "  ".join(f"{os.path.basename(os.path.normpath(s))[:14]:>14}" for s in sets) + "  "
          + "  ".join(f"{e:>8}" for e in extras))
    rows = [(f"{p['alpha']:5.2f}", p) for p in report["points"]] + ([("  ref", ref)] if ref else [])
    for label, p in rows:
        cells = [p["target"][s] for s in report["targets"]] + [p["keep"][s] for s in report["keep"]]
        extra = [p.get("kept_fraction"), p.get("gain_fraction"), *([p.get("reference_gain_fraction")] if ref else [])]
        print(f"{label}  " + "  ".join(f"{100 * c:13.2f}%" for c in cells) + "  "
              + "  ".join(f"{'-':>8}" if e is None else f"{100 * e:7.1f}%" for e in extra))
    if ref:
        print(f"ref: {ref['path']}")


if __name__ == "__main__":
    sys.exit(main())
