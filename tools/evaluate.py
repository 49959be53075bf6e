"""Score a checkpoint or export on a suite of labelled sets: CLIP_benchmark JSON, a CSV, a Markdown
table, suite averages and 95% bootstrap intervals; or compare two with a paired bootstrap.

    python tools/evaluate.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt \
        --suite configs/eval/demo.yaml --output eval/demo_clip
    python tools/evaluate.py --compare A.ckpt B.ckpt --suite configs/eval/demo.yaml --output eval/a_vs_b

``--ckpt`` takes an mmssl Lightning checkpoint (MAE, CLIP, fine-tuned ImageClassifier), a state
dict with ``--model`` (open_clip name / JSON, or timm name), or an export folder (``open_clip_hf``,
timm hub, transformers ``CLIPModel``). The suite file (``mmssl.evaluation.suite``) is checked
before any model is loaded. Written into ``--output``: ``SET_TASK_PROTOCOL.json`` per result
(CLIP_benchmark's keys, plus ``protocol``, ``ci95``, ``skipped``), ``results.csv``, ``results.md``
and ``summary.json``; with ``--compare``, ``a/`` and ``b/`` so, and ``compare.json`` /
``compare.md`` (B - A per set, its interval and two-sided p-value). ``--ema`` scores a checkpoint's
EMA of the weights (both checkpoints' with ``--compare``) instead of its raw weights; a file or
folder without one is refused, naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_encoder
from mmssl.evaluation.features import FEATURES
from mmssl.evaluation.report import compare, compare_markdown, write_report
from mmssl.evaluation.runner import Runner
from mmssl.evaluation.suite import Suite, load_suite
from mmssl.tools._common import add_loader_arguments, add_output_json, run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p, ckpt_required=False)
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="score two checkpoints and the paired B - A")
    p.add_argument("--suite", required=True, help="suite YAML: sets with their tasks")
    p.add_argument("--output", required=True, help="folder for the JSON, CSV and Markdown files")
    p.add_argument("--feature", choices=FEATURES, default="embedding",
                   help="image feature of every task (embedding: encode_image, what zero-shot needs)")
    p.add_argument("--resamples", type=int, help="bootstrap draws (default: the suite's, else 1000)")
    p.add_argument("--seed", type=int, help="bootstrap and probe seed (default: the suite's, else 0)")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --output")
    add_loader_arguments(p)
    add_output_json(p, help="also write the summary (or the comparison) here")
    args = p.parse_args(argv)
    if (args.ckpt is None) == (args.compare is None):
        p.error("give one of --ckpt or --compare A B")
    return args


def _check_output(folder: str, overwrite: bool) -> None:
    if os.path.isfile(folder):
        raise NotADirectoryError(f"--output {folder!r} is a file")
    if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
        raise FileExistsError(f"--output {folder!r} is not empty: pass --overwrite to replace its results")


def _score(args: argparse.Namespace, suite: Suite, ckpt: str, folder: str, title: str):
    model = load_encoder(ckpt, args.model, args.model_kwargs, args.model_class, args.ema)
    runner = Runner(model, suite, args.feature, args.batch_size, args.num_workers)
    results = runner.run(log=lambda line: print(line, file=sys.stderr))
    name = args.model or type(model).__name__
    summary = write_report(results, folder, name, ckpt, suite.resamples, suite.seed, title)
    with open(os.path.join(folder, "results.md"), encoding="utf-8") as f:
        print(f.read())
    return results, summary


def _report(args: argparse.Namespace) -> None:
    suite = load_suite(args.suite)  # every entry checked before a model is loaded
    for path in args.compare or [args.ckpt]:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--ckpt: nothing at {path!r}")
    suite.resamples = args.resamples or suite.resamples
    suite.seed = suite.seed if args.seed is None else args.seed
    _check_output(args.output, args.overwrite)
    if args.ckpt:
        _, out = _score(args, suite, args.ckpt, args.output, f"{args.ckpt} on {args.suite}")
    else:
        a, b = args.compare
        results_a, _ = _score(args, suite, a, os.path.join(args.output, "a"), f"A: {a}")
        results_b, _ = _score(args, suite, b, os.path.join(args.output, "b"), f"B: {b}")
        rows = compare(results_a, results_b, suite.resamples, suite.seed)
        out = {"a": a, "b": b, "comparison": rows}
        with open(os.path.join(args.output, "compare.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        table = compare_markdown(rows, a, b)
        with open(os.path.join(args.output, "compare.md"), "w", encoding="utf-8") as f:
            f.write(table)
        print(table)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    print(f"wrote {args.output}")


def main(argv: Optional[list[str]] = None) -> int:
    """Score (or compare) and write the reports; the exit status."""
    args = parse_args(argv)
    return run("evaluate", lambda: _report(args))


if __name__ == "__main__":
    sys.exit(main())
