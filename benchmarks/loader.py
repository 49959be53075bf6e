"""Training loader alone (no model): images/s per worker, mmssl against open_clip_train's webdataset pipeline.

    python benchmarks/synthetic_shards.py --output /tmp/s512 --size 512 --count 1024
    python benchmarks/loader.py --data /tmp/s512 --num-workers 1 --batch-size 64 --batches 10 --repeats 3

Both read the same shards with the same worker count, batch size, 224-pixel output and open_clip
``ViT-B-32`` tokenizer, resampled shards (open_clip_train's ``--dataset-resampled``):

- ``open_clip``: ``open_clip_train.data.get_wds_dataset`` with ``open_clip.image_transform(224,
  is_train=True)`` (RandomResizedCrop scale (0.9, 1), bicubic, ToTensor, Normalize, per sample;
  tokenised per sample), which is what ``open_clip_train.main`` builds; its tar reader gets the
  end-of-shard fix of ``benchmarks/open_clip_peer.py``.
- ``mmssl``: ``ImageTextDataModule.train_dataloader()`` as ``mmssl fit`` on a CPU builds it (crop
  to uint8 per sample, one normalise and one tokenizer call per batch in the worker, reduced-size
  JPEG decode);
- ``mmssl-uint8``: the same, shipping uint8 and normalising after the transfer
  (``normalize_on_device``, as on a GPU; here the "device" is the CPU, so the main process pays it);
- ``mmssl-full-decode``: ``mmssl-uint8`` with ``reduced_decode=false``.

Reported per tool: images/s per worker (median of the repeats, the tools alternating within each
repeat) and the main process's CPU time per batch (what a CPU training step loses to the loader).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch

TOOLS = ("open_clip", "mmssl", "mmssl-uint8", "mmssl-full-decode")


def open_clip_batches(shards: list[str], workers: int, batch_size: int, image_size: int = 224) -> Iterator[Any]:
    """open_clip_train's training loader over ``shards`` (its own pipeline and preprocess)."""
    import open_clip
    import open_clip_train.data as data
    from open_clip_peer import eof_free_tar_expander

    data.tarfile_to_samples_nothrow = eof_free_tar_expander(data)  # webdataset 1.0's end marker
    preprocess = open_clip.image_transform(image_size, is_train=True)
    args = SimpleNamespace(train_data="::".join(shards), dataset_resampled=True, train_num_samples=10**7,
                           train_data_upsampling_factors=None, batch_size=batch_size, workers=workers,
                           world_size=1, seed=0)
    info = data.get_wds_dataset(args, preprocess, is_train=True, tokenizer=open_clip.get_tokenizer("ViT-B-32"))
    for images, texts in info.dataloader:
        yield images, texts


def mmssl_batches(shards: str, workers: int, batch_size: int, uint8: bool, reduced_decode: bool,
                  image_size: int = 224) -> Iterator[Any]:
    """mmssl's training loader; with ``uint8`` the batch is normalised after it arrives, as on a GPU."""
    import open_clip

    from mmssl.data.datamodule import ImageTextDataModule

    dm = ImageTextDataModule(train_data=shards, batch_size=batch_size, num_workers=workers, resampled=True,
                             train_num_samples=10**7, image_size=image_size,
                             tokenizer=open_clip.get_tokenizer("ViT-B-32"), reduced_decode=reduced_decode,
                             normalize_on_device=uint8, trim_text_padding=True)
    for batch in dm.train_dataloader():
        batch = dm.on_after_batch_transfer(dm.on_before_batch_transfer(batch, 0), 0)
        yield batch["image"], batch["text"]


def measure(tool: str, shards: str, workers: int, batch_size: int, warmup: int, batches: int) -> dict[str, float]:
    """Time ``batches`` batches after ``warmup`` (worker start and shuffle-buffer fill excluded)."""
    from mmssl.data.sources import expand_urls

    if tool == "open_clip":
        stream = open_clip_batches(expand_urls(shards), workers, batch_size)
    else:
        stream = mmssl_batches(shards, workers, batch_size, uint8=tool != "mmssl",
                               reduced_decode=tool != "mmssl-full-decode")
    for _ in range(warmup):
        images, _ = next(stream)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        images, texts = next(stream)
        if images.dtype != torch.float32 or images.shape[1:] != (3, 224, 224):
            raise RuntimeError(f"{tool}: got images {images.dtype} {tuple(images.shape)}")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stream.close()
    return {"images_per_s_per_worker": batches * batch_size / wall / max(1, workers),
            "main_cpu_ms_per_batch": cpu / batches * 1e3}


def _option(parser: argparse.ArgumentParser, name: str, old: str, **kwargs: Any) -> None:
    """``name``, with ``old`` still accepted and hidden from --help (the tools' convention, tools/_common.py)."""
    group = parser.add_mutually_exclusive_group(required=kwargs.pop("required", False))
    action = group.add_argument(name, **{**kwargs, "help": f"{kwargs.get('help', '')} ({old}: the old spelling, "
                                                           "deprecated, still accepted)".strip()})
    group.add_argument(old, dest=action.dest, **{**kwargs, "help": argparse.SUPPRESS})


def main(argv: Optional[list[str]] = None) -> int:
    """Run the loaders, print the table (and write ``--output-json``); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _option(
        parser, "--data", "--shards", required=True, help="shard folder or pattern (benchmarks/synthetic_shards.py)"
    )
    _option(parser, "--num-workers", "--workers", type=int, default=1, help="loader worker processes")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches")
    parser.add_argument("--batches", type=int, default=10, help="timed batches")
    parser.add_argument("--repeats", type=int, default=1, help="rounds, the tools alternating")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, of {TOOLS}")
    _option(parser, "--output-json", "--json", help="write every run here as JSON")
    args = parser.parse_args(argv)
    tools = args.tools.split(",")
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        parser.error(f"--tools: unknown {unknown}; choose from {TOOLS}")
    torch.set_num_threads(1)  # the main process only receives batches, as a trainer's loader does
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in tools}
    for _ in range(args.repeats):
        for tool in tools:
            runs[tool].append(measure(tool, args.data, args.num_workers, args.batch_size, args.warmup, args.batches))
    result = {"shards": args.data, "workers": args.num_workers, "batch_size": args.batch_size, "runs": runs,
              "median": {t: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for t, rs in runs.items()}}
    base = result["median"].get("open_clip", {}).get("images_per_s_per_worker")
    print(f"{args.data}: {args.num_workers} workers, batch {args.batch_size}, {args.batches} timed batches, "
          f"{args.repeats} repeats (median)")
    print(f"{'tool':<20}{'images/s/worker':>17}{'vs open_clip':>14}{'main CPU ms/batch':>19}")
    for tool, m in result["median"].items():
        ratio = f"{m['images_per_s_per_worker'] / base:.2f}x" if base else "-"
        print(f"{tool:<20}{m['images_per_s_per_worker']:>17.1f}{ratio:>14}{m['main_cpu_ms_per_batch']:>19.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
