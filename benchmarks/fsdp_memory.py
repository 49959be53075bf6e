"""What FSDP2 buys: per-rank memory and step time under DDP and FSDP2, measured and by arithmetic.

Measured (CPU, gloo, one process per rank, fp32): each rank builds the recipe's model as `mmssl fit`
builds it, wraps it in DDP or shards it with ``mmssl.sharding.shard_module`` (what
``configure_model`` does under ``configs/trainer/fsdp2*.yaml``), and trains ``--steps`` steps on a
random batch with the recipe's AdamW. Per rank:

- ``params`` / ``grads`` / ``optim``: bytes of the tensors this rank holds (its shards under FSDP2);
- ``peak_step``: the resident set's high-water mark over the timed steps above the resident set at
  rest (activations, the gathered blocks of FSDP2, allocator caching);
- ``step_s``: median wall time of the timed steps (all ranks share the machine's cores: a
  comparison of strategies, not a throughput figure).

Arithmetic: per-GPU bytes of parameters, gradients and AdamW state for N GPUs, fp32 master weights
(DDP: 16 bytes per parameter on every GPU; FSDP2 with bf16 compute: 16 / N, plus two gathered bf16
blocks), and the largest per-GPU batch that leaves room for activations on an 80 GB and a 141 GB
GPU, from the activation bytes per sample measured here (fp32) halved for bf16.

    python benchmarks/fsdp_memory.py                         # MAE ViT-B/16 and CLIP ViT-B/32, 2 and 4 ranks
    python benchmarks/fsdp_memory.py --ranks 2 --models mae_vit_b16 --steps 2
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GB = 1e9
# Recipes as `configs/mae/vit_base_patch16.yaml` and `configs/clip/vit_b32.yaml` build them.
MODELS = {
    "mae_vit_b16": dict(image_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                        decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mask_ratio=0.75),
    "clip_vit_b32": dict(model_name="ViT-B-32"),
}
# Largest ViTs of each recipe family for the arithmetic: (timm name, image size).
ARITHMETIC = [("vit_base_patch16_224", 224), ("vit_large_patch16_224", 224), ("vit_huge_patch14_224", 224),
              ("vit_giant_patch14_224", 224), ("vit_gigantic_patch14_224", 224)]


def _build(name: str) -> torch.nn.Module:
    if name.startswith("mae"):
        from mmssl.models.mae import MAE

        return MAE(**MODELS[name])
    from mmssl.models.clip import CLIP

    return CLIP(**MODELS[name])


def _loss(model: torch.nn.Module, name: str, batch: int) -> torch.Tensor:
    images = torch.randn(batch, 3, 224, 224)
    if name.startswith("mae"):
        return model(images)[0]
    tokens = torch.randint(1, 49000, (batch, 77))
    return model.contrastive_loss(model(images, tokens))


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the kernel's resident high-water mark (Linux)
    except OSError:
        pass


def _worker(rank: int, world: int, port: int, name: str, strategy: str, batch: int, steps: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _build(name)
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        from mmssl.sharding import ShardingPolicy, shard_module

        if hasattr(model, "scalars_as_vectors"):
            model.scalars_as_vectors()  # FSDP2 shards no 0-d parameter (CLIP.configure_model does this)
        shard_module(model, init_device_mesh("cpu", (world,)), ShardingPolicy())
        run = model
    else:
        run = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.05)
    times, rest, peak = [], 0, 0
    for step in range(steps + 1):
        if step == 1:  # the first step creates the optimizer state: measure after it
            rest = _rss()
            _reset_peak()
        dist.barrier()
        start = time.perf_counter()
        loss = _loss(run, name, batch) if strategy == "fsdp2" else _loss(run.module, name, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if step >= 1:
            times.append(time.perf_counter() - start)
    peak = _peak_rss()
    row = dict(params=_local_bytes(model.parameters()), grads=_local_bytes(p.grad for p in model.parameters()
                                                                          if p.grad is not None),
               optim=_local_bytes(v for s in optimizer.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor) and v.ndim > 0),
               peak_step=max(0, peak - rest), step_s=statistics.median(times),
               n_params=sum(p.numel() for p in model.parameters()) if strategy == "ddp" else None)
    gathered = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def measure(name: str, strategy: str, world: int, batch: int, steps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, name, strategy, batch, steps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=3600)
    for p in procs:
        p.join()
    return rows


def arithmetic(act_per_sample_fp32: float, gpus: int, capacity_gb: float) -> list[tuple]:
    """(model, params, DDP GB/GPU, FSDP2 GB/GPU, DDP batch, FSDP2 batch) by the arithmetic above.

    A batch of 0 means the model's states alone do not fit (DDP) or leave no room."""
    import timm

    rows = []
    for timm_name, _size in ARITHMETIC:
        with torch.device("meta"):
            model = timm.create_model(timm_name)
        n = sum(p.numel() for p in model.parameters())
        block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
        ddp = 16 * n / GB
        fsdp2 = (16 * n / gpus + 2 * 2 * block) / GB
        free = capacity_gb - 2.0  # CUDA context, allocator slack
        # Activations grow with depth x width x tokens: scaled from the measured ViT-B/16 (12 x 768 x 197).
        scale = len(model.blocks) * model.embed_dim * model.patch_embed.num_patches / (12 * 768 * 196)
        per_sample = act_per_sample_fp32 * scale / 2 / GB  # bf16 activations
        fit = lambda used: max(0, int((free - used) / per_sample)) if per_sample > 0 else 0  # noqa: E731
        rows.append((timm_name, n, ddp, fsdp2, fit(ddp), fit(fsdp2)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch", type=int, default=2, help="samples per rank")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one untimed)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the arithmetic")
    parser.add_argument("--activation-mb", type=float, default=None,
                        help="skip the measurement: fp32 activation MB per sample of ViT-B/16 MAE for the arithmetic")
    args = parser.parse_args(argv)
    if args.activation_mb is not None:
        args.models, act = [], {"mae_vit_b16": args.activation_mb * 1e6}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, fp32, batch {args.batch} per rank")
    print(f"{'model':14s} {'strategy':8s} {'ranks':>5s} {'params MB':>10s} {'grads MB':>9s} {'optim MB':>9s} "
          f"{'peak step MB':>12s} {'step s':>7s}")
    act = {} if args.activation_mb is None else act
    for name in args.models:
        for world in args.ranks:
            for strategy in ("ddp", "fsdp2"):
                rows = measure(name, strategy, world, args.batch, args.steps)
                r = max(rows, key=lambda x: x["params"] + x["grads"] + x["optim"])
                print(f"{name:14s} {strategy:8s} {world:5d} {r['params'] / 1e6:10.1f} {r['grads'] / 1e6:9.1f} "
                      f"{r['optim'] / 1e6:9.1f} {r['peak_step'] / 1e6:12.1f} {r['step_s']:7.2f}", flush=True)
                if strategy == "ddp":
                    act.setdefault(name, r["peak_step"] / args.batch)
    per_sample = act.get("mae_vit_b16", next(iter(act.values())))
    for capacity in (80, 141):
        print(f"\nArithmetic, {args.gpus} GPUs of {capacity} GB, bf16 compute, fp32 master weights and AdamW; "
              f"activations {per_sample / 2 / 1e6:.0f} MB per sample for ViT-B/16 "
              "(the MAE recipe measured here, fp32 / 2), "
              "scaled by depth x width x patches for the others")
        print(f"{'model':26s} {'params':>8s} {'DDP GB':>7s} {'FSDP2 GB':>9s} {'DDP batch':>10s} {'FSDP2 batch':>12s}")
        for model, n, ddp, fsdp2, b_ddp, b_fsdp2 in arithmetic(per_sample, args.gpus, capacity):
            print(f"{model:26s} {n / 1e6:7.0f}M {ddp:7.1f} {fsdp2:9.2f} {b_ddp:10d} {b_fsdp2:12d}")
        room = (capacity - 2.0) * GB
        print("largest model whose weights, gradients and AdamW state fit at all (batch 1 aside): "
              f"DDP {room / 16 / 1e9:.1f}B parameters, "
              f"FSDP2 over {args.gpus} GPUs {room / (16 / args.gpus) / 1e9:.0f}B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
