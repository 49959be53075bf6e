"""Write webdataset shards (img2dataset layout) from an image folder or a CSV/TSV.

    python tools/make_shards.py --data imgs/ --output shards/ --template "a photo of a {c}."
    python tools/make_shards.py --data pairs.tsv --output shards/ --shard-size 5000 --resize 256

``--data`` is an image folder or a table (a file). A folder holds one sub-folder per class: each
image gets ``cls`` (class index, folders sorted) and a caption from the template, and the output
is a clip_benchmark ``wds/`` set:
``OUTPUT/{split}/0.tar ..`` with ``nshards.txt`` (``--split``, default ``train``), and
``classnames.txt`` plus ``zeroshot_classification_templates.txt`` (the caption template) at
``OUTPUT``, so ``clip_benchmark eval --dataset wds/NAME --dataset_root OUTPUT --split train`` and
mmssl's tools both read it. A table has rows ``path,caption[,label]`` and writes its shards to
``OUTPUT`` itself (``OUTPUT/{split}`` in the clip_benchmark layout with ``--split``). Samples are
shuffled across the shards (``--seed``; ``--no-shuffle`` keeps the input order), so no shard
holds one class. Writes ``sizes.json`` beside the shards, last: until then ``incomplete.json``
stands there, so the shards of an interrupted run are known as such (``inspect_shards.py`` calls
them incomplete). A folder that already holds shards is refused; ``--overwrite`` replaces those an
earlier run wrote (the ones its ``sizes.json`` lists, or an interrupted run's) and still refuses any
other ``.tar``: no file make_shards did not write is deleted. ``--output`` may not be the image
folder or inside it.
"""

import argparse
import errno
import os
import sys

from mmssl.data.folders import folder_items, shuffled
from mmssl.data.shards import table_items, write_clip_benchmark_files, write_shards
from mmssl.tools._common import add_option, run


def check_not_inside(data: str, outputs: list[str]) -> None:
    """Refuse an output folder that is the input image folder or inside it: the shards (and a
    rerun's images listed from it) would mix with the images."""
    source = os.path.realpath(data)
    for out in outputs:
        target = os.path.realpath(out)
        if target == source or target.startswith(source + os.sep):
            raise ValueError(f"--output {out!r} is inside --data {data!r}: the shards would be written among the "
                             "images they are made from; name a folder outside it")


def check_case_twins(data: str, names: list[str]) -> None:
    """Refuse class folders whose names differ only in case: CLIP's tokenizer lower-cases text, so
    their captions and zero-shot prompts would be one text for two classes."""
    seen: dict[str, str] = {}
    for name in names:
        twin = seen.setdefault(name.casefold(), name)
        if twin != name:
            raise ValueError(f"--data {data!r}: the class names {twin!r} and {name!r} of its folders differ only in "
                             "case, so their captions and prompts would be the same text (the tokenizer lower-cases): "
                             "merge or rename one")


def main(argv: list[str] | None = None) -> int:
    """Write the shards of ``--data`` to ``--output``; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(parser, "--data", "--folder", "--table", required=True,
               help="image folder with one sub-folder per class, or a CSV/TSV file with path,caption[,label]")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--split", help="clip_benchmark split folder (default for a folder: train)")
    parser.add_argument("--template", default="a photo of a {c}.", help="caption template ({c}: class)")
    parser.add_argument("--shard-size", type=int, default=10000, help="samples per shard")
    parser.add_argument("--resize", type=int, default=None, help="shrink the short side to this")
    parser.add_argument("--prefix", default="", help="shard file name prefix (not with --split)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle across shards")
    parser.add_argument("--no-shuffle", action="store_true", help="write samples in input order")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards an earlier run wrote to OUTPUT")
    args = parser.parse_args(argv)
    folder = os.path.isdir(args.data)
    if folder:
        if "{c}" not in args.template:
            parser.error(f"--template {args.template!r} has no '{{c}}' for the class name")
        try:
            args.template.format(c="class")
        except (KeyError, IndexError, ValueError) as err:
            parser.error(f"--template {args.template!r}: only '{{c}}' is filled in (the class name), and a literal "
                         f"brace is written '{{{{' or '}}}}' ({type(err).__name__}: {err})")
        args.split = args.split or "train"
    if args.split and args.prefix:
        parser.error("--prefix: clip_benchmark's layout names its shards 0.tar, 1.tar, ...")
    return run("make_shards", lambda: _write(args, folder))


def _write(args: argparse.Namespace, folder: bool) -> None:
    names = None
    if folder:
        check_not_inside(args.data, [args.output, os.path.join(args.output, args.split)])
        items, names = folder_items(args.data, args.template)
        check_case_twins(args.data, names)
    elif os.path.exists(args.data):
        items = table_items(args.data)
    else:
        raise FileNotFoundError(errno.ENOENT, "no such image folder or table", args.data)
    if not args.no_shuffle:
        items = shuffled(items, args.seed)
    out = os.path.join(args.output, args.split) if args.split else args.output
    sizes = write_shards(items, out, args.shard_size, args.resize, args.prefix, len(items), args.overwrite,
                         numbered=bool(args.split))
    if args.split:
        write_clip_benchmark_files(args.output, args.split, names, [args.template] if names else None)
    print(f"wrote {sum(sizes.values())} samples in {len(sizes)} shards to {out}")


if __name__ == "__main__":
    sys.exit(main())
