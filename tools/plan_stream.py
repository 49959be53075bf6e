"""Plan exact-epoch training for a cluster from ``sizes.json`` alone (no image is read).

    python tools/plan_stream.py --data 'shards/{00000..01281}.tar' --nodes 8 --devices 8 \\
        --num-workers 10 --batch-size 256 --epochs 2 --seed 0

Prints batches per rank, samples read and left out per epoch, samples read twice (duplicates),
the samples before slot ranges that start inside a shard (a local tar is entered there by seeking;
URLs and ``pipe:`` read and drop them), and how shards move between slots and ranks from one epoch
to the next (see ``mmssl.data.plan``).
"""

import argparse
import sys

from mmssl.data.plan import Topology, describe
from mmssl.data.sources import expand_urls, shard_sizes
from mmssl.tools._common import add_loader_arguments, run


def main(argv: list[str] | None = None) -> int:
    """Print the plan of ``--data`` on the topology given; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="shard pattern or folder; sizes.json beside the shards")
    parser.add_argument("--nodes", type=int, default=1, help="nodes")
    parser.add_argument("--devices", type=int, default=1, help="devices (ranks) per node")
    add_loader_arguments(parser, batch_size=None, num_workers=1, old_workers=("--workers",),
                         batch_help="data.batch_size (per device)", workers_help="data.num_workers (0 counts as 1)")
    parser.add_argument("--shuffle-buffer", type=int, default=1000, help="data.shuffle_buffer")
    parser.add_argument("--epochs", type=int, default=2, help="epochs to plan")
    parser.add_argument("--seed", type=int, default=0, help="data.seed")
    args = parser.parse_args(argv)
    for flag, value, least in (
        ("--nodes", args.nodes, 1),
        ("--devices", args.devices, 1),
        ("--num-workers", args.num_workers, 0),
        ("--batch-size", args.batch_size, 1),
        ("--shuffle-buffer", args.shuffle_buffer, 1),
    ):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    return run("plan_stream", lambda: _plan(args))


def _plan(args: argparse.Namespace) -> int:
    urls = expand_urls(args.data, must_exist=False)
    sizes = shard_sizes(urls, scan=False)  # a malformed sizes.json: ValueError naming it
    if sizes is None:
        raise ValueError(f"no sizes.json lists every shard of {args.data!r}: exact epochs need one "
                         "(tools/make_shards.py writes it)")
    world, workers = args.nodes * args.devices, max(1, args.num_workers)
    topology = Topology(world, workers, args.batch_size, args.shuffle_buffer)
    s = describe(sizes, topology, args.seed, max(1, args.epochs))
    if s.rank_batches == 0:
        raise ValueError(
            f"{args.data}: {s.samples} samples cannot fill one global batch of {world} x {args.batch_size}"
        )
    print(f"data:              {s.shards:,} shards, {s.samples:,} samples (sizes.json)")
    print(f"topology:          {args.nodes} nodes x {args.devices} devices = {world} ranks, x {workers} workers = "
          f"{world * workers:,} slots; batch {args.batch_size} per rank")
    print(
        f"batches per rank:  {s.rank_batches:,} per epoch ({s.worker_batches[0]:,}-{s.worker_batches[1]:,} per worker)"
    )
    print(f"samples per epoch: {s.read:,} read, {s.left_out:,} left out "
          f"(< {world} x {args.batch_size} = {world * args.batch_size:,}; other samples each epoch)")
    epochs = ", ".join(map(str, range(len(s.duplicates))))
    print(f"duplicates:        {', '.join(f'{d:,}' for d in s.duplicates)} (epoch {epochs})")
    print("ranges mid-shard:  " + ", ".join(f"{r:,} ({r / s.read:.1%})" for r in s.skipped_reads)
          + " samples precede slot ranges inside shards (local tars: seeked over; URLs: read, not decoded)")
    for epoch, (slot, rank) in enumerate(zip(s.slot_changed, s.rank_changed)):
        print(
            f"mixing {epoch} -> {epoch + 1}:      {slot:.1%} of shards read by other slots, {rank:.1%} by other ranks"
        )
    print(f"planning time:     {s.seconds:.3f} s per epoch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
