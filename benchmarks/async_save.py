"""Seconds each training step is blocked per sharded save: synchronous against asynchronous.

    python benchmarks/async_save.py --width 2048 --layers 8 --steps 12 --every 3 --repeats 2

Two gloo processes (CPU) shard an MLP of ``--layers`` square Linear layers with FSDP2
(``fully_shard`` per layer and at the root, as ``mmssl.sharding`` does for transformer blocks),
train it with AdamW and save ``last.ckpt`` every ``--every`` steps through
:class:`mmssl.checkpoints.sharded.FSDP2Strategy`: ``async_mode="disabled"`` (the folder written,
completed and renamed before the step goes on) against ``"async"`` (the step waits for the staging
copy; the write, ``meta.pt`` and the rename run in the background). The two modes alternate
``--repeats`` times in the same processes. Prints per mode the median seconds a save blocks the
step, the median step without a save, the loop's wall time, and (async) the seconds from a save's
return until its folder was in place (the write hidden behind the steps). The state saved per
checkpoint: the weights and AdamW's two moments, fp32, ``--width``² x ``--layers`` x 3 x 4 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def _strategy(rank: int, mode: str):
    from lightning.fabric.plugins.environments import LightningEnvironment

    from mmssl.checkpoints.sharded import FSDP2Strategy

    strategy = FSDP2Strategy(async_mode=mode)
    strategy.cluster_environment = LightningEnvironment()
    strategy.cluster_environment.set_global_rank(rank)
    strategy.cluster_environment.set_world_size(2)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    return strategy


def _loop(rank: int, args: argparse.Namespace, model, optimizer, mode: str, folder: Path) -> dict:
    """``args.steps`` steps, a save every ``args.every``: the seconds of each part."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    strategy, last = _strategy(rank, mode), folder / "last.ckpt"
    blocked, steps, landed = [], [], []
    x = torch.randn(args.batch_size, args.width)
    torch.distributed.barrier()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        began = time.perf_counter()
        strategy.on_train_batch_start(None, step)  # where a failed background write is raised
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
        steps.append(time.perf_counter() - began)
        if step % args.every == 0:
            began = time.perf_counter()
            checkpoint = {"state_dict": get_model_state_dict(model),
                          "optimizer_states": [get_optimizer_state_dict(model, optimizer)], "global_step": step}
            strategy.save_checkpoint(checkpoint, str(last))
            blocked.append(time.perf_counter() - began)
            if mode == "async":
                returned, pending = time.perf_counter(), strategy._async._pending
                pending.add_done_callback(lambda _, t=returned: landed.append(time.perf_counter() - t))
    if strategy._async is not None:
        strategy._async.close()  # the end of training: the last write in place
    wall = time.perf_counter() - start
    return {"blocked_s": blocked, "step_s": steps, "wall_s": wall, "write_after_return_s": landed}


def _worker(rank: int, args: argparse.Namespace, folder: str) -> None:
    from datetime import timedelta

    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=10))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    results: dict = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode, name in (("disabled", "sync"), ("async", "async")):
            target = Path(folder) / name
            results[name].append(_loop(rank, args, model, optimizer, mode, target))
    if rank == 0:
        state_mb = 3 * 4 * sum(p.numel() for p in model.parameters()) / 2 ** 20  # whole, both ranks
        _report(args, results, state_mb)
    torch.distributed.destroy_process_group()


def _report(args: argparse.Namespace, results: dict, state_mb: float) -> None:
    summary = {}
    for name, runs in results.items():
        blocked = [t for run in runs for t in run["blocked_s"]]
        plain = [t for run in runs for t in run["step_s"]]
        landed = [t for run in runs for t in run["write_after_return_s"]]
        summary[name] = {"blocked_per_save_s": statistics.median(blocked), "blocked_max_s": max(blocked),
                         "step_s": statistics.median(plain), "wall_s": statistics.median(r["wall_s"] for r in runs),
                         "saves": len(blocked)}
        if landed:
            summary[name]["in_place_after_return_s"] = statistics.median(landed)
    print(f"state saved per checkpoint: {state_mb:.0f} MB (weights + AdamW moments, fp32; each rank writes half); "
          f"{args.steps} steps, a save every {args.every}, {args.repeats} repeats per mode, 2 gloo ranks, "
          f"{args.threads} thread(s) each")
    print(f"{'mode':6} {'blocked/save s':>15} {'max s':>7} {'step s':>7} {'loop wall s':>12} {'in place after s':>17}")
    for name, row in summary.items():
        after = row.get("in_place_after_return_s")
        print(f"{name:6} {row['blocked_per_save_s']:15.3f} {row['blocked_max_s']:7.3f} {row['step_s']:7.3f} "
              f"{row['wall_s']:12.2f} {'' if after is None else f'{after:17.3f}'}")
    print(json.dumps({"args": vars(args), "state_mb": state_mb, **summary}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--folder", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--port", type=int, default=29617)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    folder = args.folder or tempfile.mkdtemp(prefix="async_save_")
    try:
        mp.start_processes(_worker, args=(args, folder), nprocs=2, start_method="spawn")
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
