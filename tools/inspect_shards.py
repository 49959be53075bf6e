"""Count and validate every sample of some shards, report bad ones, print a few.

    python tools/inspect_shards.py --data "shards/{00000..00009}.tar" --show 3

Checks every sample (the image decodes, the caption is non-empty UTF-8, ``cls`` is a class index
in [0, 2**63)) and every shard against the ``sizes.json`` beside it (valid JSON mapping shard names
to non-negative integers, each count equal to the samples the shard holds: training counts a
difference as bad samples); a folder whose writer (``make_shards.py``) was interrupted before its
``sizes.json`` (its ``incomplete.json`` is there) is reported incomplete. Exits with status 1 when a
sample, shard or ``sizes.json`` is bad, or a folder incomplete; warns
(status 0) about shards whose labels or captions are nearly constant, or that no ``sizes.json`` lists.
"""

import argparse
import sys

from mmssl.data.shards import inspect_shards
from mmssl.tools._common import run


def main(argv: list[str] | None = None) -> int:
    """Inspect ``--data``; the exit status (1 when a sample, shard or sizes.json is bad)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="shard pattern, folder, URL or pipe: command "
                      "(the old form, the pattern as the only positional argument, deprecated, still accepted)")
    data.add_argument("data_positional", nargs="?", metavar="DATA", help=argparse.SUPPRESS)
    parser.add_argument("--show", type=int, default=3, help="good samples to print")
    args = parser.parse_args(argv)
    return run("inspect_shards", lambda: _inspect(args.data or args.data_positional, args.show))


def _inspect(data: str, show: int) -> int:
    good, problems, shown, warnings = inspect_shards(data, show=show)
    for sample in shown:
        print(sample)
    for line in problems:
        print("BAD", line)
    for line in warnings:
        print("WARNING", line)
    print(f"{good} good samples, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
