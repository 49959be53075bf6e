"""Cost of one ``EmbeddingHealth`` call on the demo configs: median ms over repeated calls.

    python benchmarks/health_cost.py --config configs/demo/clip.yaml configs/demo/mae.yaml --repeats 5

Each config's model and data module are built by ``mmssl fit``'s own parser (no training); the
callback reads its buffer as in a run (the demo's held-out shards, first ``max_samples``) and its
``evaluate`` (the forwards over the buffer, the SVD and the pairwise distances) is timed after one
untimed warm-up call, on one process: wall time and the process's CPU time (all threads; on a
shared, loaded machine the CPU time is the steadier figure). Prints one line per config and a JSON list with
``--output-json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's mmssl, run as a script

from mmssl.callbacks import EmbeddingHealth  # noqa: E402
from mmssl.cli import MMSSLCLI  # noqa: E402


def build(config: str) -> MMSSLCLI:
    """The config's model, data module and trainer, as ``mmssl fit`` builds them (not run)."""
    import lightning.pytorch as pl

    return MMSSLCLI(model_class=pl.LightningModule, datamodule_class=pl.LightningDataModule, subclass_mode_model=True,
                    subclass_mode_data=True, run=False, args=["--config", config, "--trainer.logger=false"])


def time_calls(config: str, repeats: int, max_samples: int) -> dict:
    """Median and spread of ``repeats`` timed calls of the callback on ``config``'s demo model."""
    cli = build(config)
    dm, model = cli.datamodule, cli.model
    dm.prepare_data()
    dm.setup("fit")
    trainer = types.SimpleNamespace(  # one process; what the callback reads of a trainer
        datamodule=dm, world_size=1, global_rank=0, is_global_zero=True, global_step=0, limit_val_batches=1.0,
        precision_plugin=cli.trainer.precision_plugin)
    health = EmbeddingHealth(max_samples=max_samples)
    health.setup(trainer, model, "validate")
    health.evaluate(trainer, model)  # warm-up
    times, cpu, figures = [], [], {}
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        figures = health.evaluate(trainer, model)
        times.append(1000 * (time.perf_counter() - start))
        cpu.append(1000 * (time.process_time() - start_cpu))
    return {"config": config, "samples": len(health.buffer), "threads": torch.get_num_threads(),
            "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "median_cpu_ms": statistics.median(cpu), "figures": figures}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", nargs="+", default=["configs/demo/clip.yaml", "configs/demo/mae.yaml"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-samples", type=int, default=256)
    parser.add_argument("--output-json", help="write the results here")
    args = parser.parse_args(argv)
    results = []
    for config in args.config:  # each line as soon as its config is done
        results.append(r := time_calls(config, args.repeats, args.max_samples))
        print(f"{r['config']}: {r['median_ms']:.0f} ms per call (min {r['min_ms']:.0f}, max {r['max_ms']:.0f}), "
              f"{r['median_cpu_ms']:.0f} ms of CPU time; {r['samples']} samples, {r['threads']} threads", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
