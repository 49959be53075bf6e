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

``--output`` holds one run's results only: they are written into a new folder beside it, which
takes its place at the end. A non-empty ``--output`` is refused, naming it, also when another run
fills it while this one scores (this run's results are then kept in the new folder, named);
``--overwrite`` replaces a folder holding an earlier run's results and nothing else, stale per-set
files included.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
import tempfile
from typing import Optional

from mmssl.evaluation.encoders import add_checkpoint_arguments, load_encoder
from mmssl.evaluation.features import FEATURES
from mmssl.evaluation.report import compare, compare_markdown, write_json, write_report, write_text
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


# What a run writes (mmssl.evaluation.report and the comparison): --overwrite deletes a folder of these only.
RESULT_FILE = re.compile(r"[^/]+\.json|results\.(csv|md)|compare\.md")


def _foreign(folder: str, depth: int = 0) -> list[str]:
    """Entries of ``folder`` that no run of this tool writes (``a/`` and ``b/`` of ``--compare`` looked into)."""
    out = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if depth == 0 and entry in ("a", "b") and os.path.isdir(path) and not os.path.islink(path):
            out += _foreign(path, 1)
        elif not (RESULT_FILE.fullmatch(entry) and os.path.isfile(path) and not os.path.islink(path)):
            out.append(path)
    return out


def _check_output(folder: str, overwrite: bool) -> None:
    """Refuse a file, a non-empty folder without ``overwrite``, or one holding what no run writes."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"--output {folder!r} is a file")
    if not os.path.isdir(folder) or not os.listdir(folder):
        return
    if not overwrite:
        raise FileExistsError(f"--output {folder!r} is not empty: name a new folder, or pass --overwrite to replace "
                              "its results")
    foreign = _foreign(folder)
    if foreign:
        raise FileExistsError(f"--output {folder!r} holds {foreign[:3]}, which tools/evaluate.py does not write: "
                              "--overwrite replaces only an earlier run's results; name another folder")


def _publish(new: str, output: str, overwrite: bool) -> None:
    """Put the finished results folder ``new`` in ``output``'s place."""
    try:
        os.rename(new, output)  # onto nothing or an empty folder; refused onto a filled one
        return
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    try:
        _check_output(output, overwrite)
    except FileExistsError as err:
        raise FileExistsError(f"{err} (it was filled while this run scored; this run's results are in {new!r})") \
            from None
    parent, name = os.path.split(os.path.abspath(output))
    old = tempfile.mkdtemp(prefix=f".{name}.old.", dir=parent)
    os.replace(output, old)
    os.replace(new, output)
    shutil.rmtree(old)


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
    parent, name = os.path.split(os.path.abspath(args.output))
    os.makedirs(parent, exist_ok=True)
    new = tempfile.mkdtemp(prefix=f".{name}.new.", dir=parent)
    try:
        out = _write_results(args, suite, new)
        os.chmod(new, 0o777 & ~_umask())
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    _publish(new, args.output, args.overwrite)
    if args.output_json:
        write_json(args.output_json, out)
    print(f"wrote {args.output}")


def _write_results(args: argparse.Namespace, suite: Suite, folder: str) -> dict:
    """Score (or compare) into ``folder``; the summary (or the comparison)."""
    if args.ckpt:
        return _score(args, suite, args.ckpt, folder, f"{args.ckpt} on {args.suite}")[1]
    a, b = args.compare
    results_a, _ = _score(args, suite, a, os.path.join(folder, "a"), f"A: {a}")
    results_b, _ = _score(args, suite, b, os.path.join(folder, "b"), f"B: {b}")
    rows = compare(results_a, results_b, suite.resamples, suite.seed)
    out = {"a": a, "b": b, "comparison": rows}
    write_json(os.path.join(folder, "compare.json"), out)
    table = compare_markdown(rows, a, b)
    write_text(os.path.join(folder, "compare.md"), table)
    print(table)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: Optional[list[str]] = None) -> int:
    """Score (or compare) and write the reports; the exit status."""
    args = parse_args(argv)
    return run("evaluate", lambda: _report(args))


if __name__ == "__main__":
    sys.exit(main())
