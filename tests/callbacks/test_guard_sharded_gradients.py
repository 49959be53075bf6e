"""NonFiniteGuard on FSDP2's gradients: DTensor shards, whose total norm is a DTensor too.

On a 1-rank gloo group in this process (the 2-process FSDP2 runs are in
``tests/checkpoints/test_fsdp2*.py``), the sync-free path (fused AdamW) reduces the sharded norm to
a plain tensor before counting: a NaN in a sharded gradient is one skipped step, a clean gradient
none, each read back at its check.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from mmssl.callbacks.guards import NonFiniteGuard
from tests.helpers import one_process_group


def test_the_fused_path_counts_a_nan_in_a_sharded_gradient_as_one_skipped_step():
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    with one_process_group():
        mesh = init_device_mesh("cpu", (1,))
        weight = nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
        optimizer = torch.optim.AdamW([weight], fused=True)
        guard = NonFiniteGuard(every_n_steps=1)
        trainer = SimpleNamespace(world_size=1, global_step=0, precision_plugin=SimpleNamespace(),
                                  should_stop=False)
        module = SimpleNamespace(device=torch.device("cpu"), log=lambda *args, **kwargs: None)
        assert NonFiniteGuard.sync_free(trainer, optimizer)
        seen = []
        for poisoned in (False, True, False):
            grad = torch.ones(4, 3)
            if poisoned:
                grad[1, 2] = float("nan")
            weight.grad = distribute_tensor(grad, mesh, [Shard(0)])
            guard.on_before_optimizer_step(trainer, module, optimizer)
            seen.append((guard.skipped, guard.consecutive))
        assert seen == [(0, 0), (1, 1), (1, 0)] and guard.host_reads == 3
