"""The GPU benchmark behind benchmarks/gpu.sh: MAE ViT-B/16 and CLIP ViT-B/32 (open_clip_train beside it).

    bash benchmarks/gpu.sh                 # one GPU, <= 8 minutes: writes shards, prints the figures
    bash benchmarks/gpu.sh --dry-run       # CPU, fp32, batch 2, 2 steps of each: checks the wiring

Both runs go through ``tools/benchmark.py``'s functions (``mmssl fit``'s own Lightning loop, a
``benchmarks/meter.py``'s ``StepTimer``), on the recipes' own configs (``configs/mae/vit_base_patch16.yaml``
and ``configs/clip/vit_b32.yaml``) cut to one device, on shards this script writes (256-pixel
JPEGs, img2dataset's usual size, with web-like caption lengths: ``synthetic_shards.py``):

- MAE ViT-B/16, mask 0.75, bf16-mixed, batch 256;
- CLIP ViT-B/32 (77-token context), bf16-mixed, batch 256, and open_clip_train on the same
  shards, model, batch, workers and precision, alternating (``--repeats``).

Printed per run: samples/s, step time, data wait, peak CUDA memory, FLOPs per step and MFU (over
the GPU's measured bf16 matmul peak). With few CPU cores per GPU both tools can be loader-bound;
the data-wait column says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

from synthetic_shards import write_bench_shards  # noqa: E402

from benchmarks.bench import benchmark, format_report  # noqa: E402

MAE_CONFIG = "configs/mae/vit_base_patch16.yaml"
CLIP_CONFIG = "configs/clip/vit_b32.yaml"


def plan(dry_run: bool, workers: Optional[int]) -> dict[str, Any]:
    """Sizes of the real run (one GPU) or of the dry run (CPU, 2 steps of each)."""
    if dry_run:
        return dict(accelerator="cpu", precision="32-true", batch=2, warmup=1, steps=1, repeats=1,
                    samples=16, workers=workers or 1)
    return dict(accelerator="gpu", precision="bf16-mixed", batch=256, warmup=10, steps=40, repeats=2,
                samples=4096, workers=workers or max(1, min(16, (os.cpu_count() or 2) - 2)))


def overrides(p: dict[str, Any], shards: str) -> list[str]:
    """The recipe cut to one device and pointed at the benchmark shards (resampled stream).

    The dry run also fuses AdamW: the recipes' foreach AdamW takes ~6 s a step over ViT-B-32's
    151M parameters on a 2-core CPU (fused: ~1 s); the GPU run keeps the recipes' optimizer, as
    open_clip_train's is the same unfused AdamW.
    """
    fused = ["--model.init_args.optimizer.init_args.fused=true"] if p["accelerator"] == "cpu" else []
    return [*fused,
        "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto",
        f"--trainer.accelerator={p['accelerator']}", f"--trainer.precision={p['precision']}",
        f"--data.init_args.train_data={shards}", f"--data.init_args.batch_size={p['batch']}",
        f"--data.init_args.num_workers={p['workers']}", "--data.init_args.resampled=true",
        f"--data.init_args.train_num_samples={10 * p['samples']}",
    ]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, fp32, batch 2, 2 steps of each")
    parser.add_argument("--workers", type=int, help="loader workers (default: CPU cores - 2, at most 16)")
    parser.add_argument("--out", help="folder for shards and results.json (default: a temporary folder)")
    parser.add_argument("--skip-open-clip", action="store_true", help="CLIP without the open_clip_train peer")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the configs are named relative to the repository
    p = plan(args.dry_run, args.workers)
    out = args.out or tempfile.mkdtemp(prefix="mmssl_gpu_bench_")
    shards = os.path.join(out, "shards256")
    started = time.perf_counter()
    if not os.path.exists(os.path.join(shards, "sizes.json")):
        write_bench_shards(shards, 256, p["samples"], shard_size=max(8, p["samples"] // 16))
    print(f"shards: {shards} ({p['samples']} samples of 256 px); {time.perf_counter() - started:.0f} s", flush=True)
    results: dict[str, Any] = {"plan": p}
    runs = (
        ("MAE ViT-B/16, mask 0.75", MAE_CONFIG, ["--model.init_args.mask_ratio=0.75"], False),
        ("CLIP ViT-B/32", CLIP_CONFIG, [], not args.skip_open_clip),
    )
    for title, config, extra, peer in runs:
        print(f"\n== {title}, {p['precision']}, batch {p['batch']} ==", flush=True)
        result = benchmark(config, [*overrides(p, shards), *extra], p["warmup"], p["steps"], compare_open_clip=peer,
                           repeats=p["repeats"] if peer else 1)
        print(format_report(result), flush=True)
        print(f"({time.perf_counter() - started:.0f} s since the start)", flush=True)
        results[title] = result
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\nall figures in {os.path.join(out, 'results.json')}; {time.perf_counter() - started:.0f} s in all")
    return results


if __name__ == "__main__":
    main()
