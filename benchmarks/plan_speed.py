"""How long the exact-epoch plan of a LAION-sized layout takes (mmssl.data.plan).

The data module plans the stream again at every ``train_dataloader`` (a resumed run's seed is
restored after setup), so a plan must stay cheap at the scale users run: 41,408 shards of ~10,000
samples (LAION-400M's img2dataset layout), 128 ranks x 10 workers, batch 256. Prints the median of
``--repeats`` plans in seconds (a figure, not a test: a wall-clock bound in a test fails on a
loaded machine; tests/data/test_stream_plan.py checks the same plan's correctness).

    python benchmarks/plan_speed.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from mmssl.data.plan import Topology, fresh_base, overlap, split_base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=41408)
    parser.add_argument("--world", type=int, default=128)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [10000 - (i % 7) for i in range(args.shards)]
    topology = Topology(world=args.world, workers=args.workers, batch=args.batch, buffer=1000)
    seconds = []
    for epoch in range(args.repeats):
        start = time.perf_counter()
        plan = split_base(fresh_base(sizes, seed=0, epoch=epoch), topology)
        seconds.append(time.perf_counter() - start)
    assert overlap(plan) == 0
    print(f"{args.shards} shards, {sum(sizes)} samples, {args.world} ranks x {args.workers} workers, batch "
          f"{args.batch}: plan median {statistics.median(seconds):.3f} s (min {min(seconds):.3f}, max "
          f"{max(seconds):.3f}, {args.repeats} runs); {plan.left_out} samples left out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
