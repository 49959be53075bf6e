"""After an evaluation that ranks ran unevenly, FSDP2's first training backward issues the same
collectives on every rank (2 gloo processes, torch's fully_shard as mmssl's strategy applies it).

FSDP2 prefetches, in each unit's backward, the unit whose forward it recorded just before, and it
keeps the forwards of an evaluation in that record until a backward ends. An evaluation on gathered
weights that rank 0 alone ran, ending in an inner block (a callback's ``encode_text``, CLIP + MLM's
corrupted captions), made rank 0 all-gather that block in the first training backward while rank 1
went on: the hang of #47. ``reshard_module`` forgets those forwards on every rank.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest

TIMEOUT_S = 90


def _worker(rank: int, port: int, queue) -> None:
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        from mmssl.checkpoints.sharded import gather_module, reshard_module

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # A desynchronised collective must fail well inside the test's timeout.
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
        for block in model:
            fully_shard(block)
        fully_shard(model)
        x = torch.randn(4, 8)
        model(x).sum().backward()  # FSDP2's lazy set-up; a backward clears its record
        model.zero_grad()
        gather_module(model)
        with torch.no_grad():
            if rank == 0:  # evaluation on rank 0 alone, ending in an inner block
                model(x)
                model[3](x)
        reshard_module(model, True)
        model(x + rank).sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        queue.put((rank, [g.sum().item() for g in grads]))
        dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        queue.put((rank, repr(exc)))


def _run() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")  # a clean child, whatever threads the suite holds
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(queue.get(timeout=TIMEOUT_S) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_the_first_backward_after_an_uneven_evaluation_matches_on_every_rank():
    results = _run()
    assert all(isinstance(r, list) for r in results.values()), results
    assert results[0] == pytest.approx(results[1])  # the same reduced gradients on both ranks

