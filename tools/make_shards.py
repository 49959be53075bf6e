"""Write webdataset shards (img2dataset layout) from an image folder or a CSV/TSV.

    python tools/make_shards.py --folder imgs/ --output shards/ --template "a photo of a {c}."
    python tools/make_shards.py --table pairs.tsv --output shards/ --shard-size 5000 --resize 256

A folder holds one sub-folder per class: each image gets ``cls`` (class index, folders sorted)
and a caption from the template; ``classnames.txt`` is written too. A table has rows
``path,caption[,label]``. Samples are shuffled across the shards (``--seed``; ``--no-shuffle``
keeps the input order), so no shard holds one class. Writes ``sizes.json`` beside the shards.
"""

import argparse
from pathlib import Path

from mmssl.data.shards import folder_items, shuffled, table_items, write_shards


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--folder", help="image folder with one sub-folder per class")
    source.add_argument("--table", help="CSV/TSV with path,caption[,label]")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--template", default="a photo of a {c}.", help="caption template ({c}: class)")
    parser.add_argument("--shard-size", type=int, default=10000, help="samples per shard")
    parser.add_argument("--resize", type=int, default=None, help="shrink the short side to this")
    parser.add_argument("--prefix", default="", help="shard file name prefix")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle across shards")
    parser.add_argument("--no-shuffle", action="store_true", help="write samples in input order")
    args = parser.parse_args(argv)
    if args.folder:
        items, names = folder_items(args.folder, args.template)
        Path(args.output).mkdir(parents=True, exist_ok=True)
        Path(args.output, "classnames.txt").write_text("\n".join(names) + "\n")
    else:
        items = table_items(args.table)
    if not args.no_shuffle:
        items = shuffled(items, args.seed)
    sizes = write_shards(items, args.output, args.shard_size, args.resize, args.prefix, total=len(items))
    print(f"wrote {sum(sizes.values())} samples in {len(sizes)} shards to {args.output}")


if __name__ == "__main__":
    main()
