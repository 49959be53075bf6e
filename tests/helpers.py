"""Callbacks that tests inject into real CLI runs (importable by subprocesses via PYTHONPATH), and
the runner of a test's own 2-rank gloo workers."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch


class KillAtStep(pl.Callback):
    """SIGKILL this process once ``global_step`` reaches ``step``: a crash with no clean-up."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def as_two_thread_ranks(monkeypatch, work: Callable[[int], Any]) -> list:
    """``[work(0), work(1)]`` run as two ranks in two threads, ``torch.distributed.all_reduce`` a
    sum of both ranks' tensors through a barrier (the in-process stand-in for a gloo all-reduce)."""
    import threading

    barrier, slots, out = threading.Barrier(2), {}, [None, None]

    def all_reduce(tensor, *args, **kwargs):
        slots[threading.get_ident()] = tensor.clone()
        barrier.wait()
        total = sum(slots.values())
        barrier.wait()
        tensor.copy_(total)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, work(r))) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def whole(tensor):
    """The whole tensor of an FSDP2 shard (a DTensor; a collective), else ``tensor``."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class DumpParams(pl.Callback):
    """Save each rank's parameters to ``{folder}/rank{R}.pt`` when training ends, and the weights
    of an ``mmssl.callbacks.EMA``'s average under ``ema/NAME``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.folder, exist_ok=True)
        # FSDP2's parameters are DTensor shards: whole tensors (a collective every rank joins here).
        state = {k: whole(v).detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        for callback in trainer.callbacks:
            average = getattr(callback, "averaged_module", lambda: None)()
            if average is not None:
                state.update({f"ema/{k}": v.detach().cpu().clone() for k, v in average.state_dict().items()})
        torch.save(state, os.path.join(self.folder, f"rank{trainer.global_rank}.pt"))


class DumpStartParams(pl.Callback):
    """Save each rank's whole parameters as training starts (after a resume has restored them)
    to ``{folder}/start_rank{R}.pt``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        os.makedirs(self.folder, exist_ok=True)
        state = {k: whole(v).detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        torch.save(state, os.path.join(self.folder, f"start_rank{trainer.global_rank}.pt"))


class DumpGrads(pl.Callback):
    """Save, at the first optimizer step, each rank's gradients (after DDP's all-reduce) of every
    parameter that has one, and the names of the trainable parameters, to ``{folder}/rank{R}.pt``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != 0:
            return
        os.makedirs(self.folder, exist_ok=True)
        named = list(pl_module.named_parameters())
        state = {"grads": {n: p.grad.detach().cpu().clone() for n, p in named if p.grad is not None},
                 "trainable": sorted(n for n, p in named if p.requires_grad)}
        torch.save(state, os.path.join(self.folder, f"rank{trainer.global_rank}.pt"))


class DumpShards(pl.Callback):
    """Write the shards this rank reads in its first epoch (and where Lightning placed it) to
    ``{folder}/rank{R}.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        import json

        spec = trainer.train_dataloader.dataset.spec
        slots = spec.plan(trainer.current_epoch).slots[spec.rank * spec.workers:(spec.rank + 1) * spec.workers]
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"node_rank": trainer.node_rank, "world_size": trainer.world_size,
                       "environment": type(trainer.strategy.cluster_environment).__name__,
                       "shards": sorted({spec.urls[p.shard] for slot in slots for p in slot})}, f)


class StallRank(pl.Callback):
    """Rank ``rank`` stops for ``seconds`` after training step ``step``, so its peers wait in the
    next collective: a desynchronised (or dead) rank. Touches ``{marker}`` when it starts."""

    def __init__(self, rank: int, step: int, seconds: float, marker: str) -> None:
        self.rank, self.step, self.seconds, self.marker = rank, step, seconds, marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            open(self.marker, "w").close()
            import time

            time.sleep(self.seconds)


def run_two_ranks(worker: Callable[..., None], folder: Path, *args: Any) -> list[Any]:
    """``worker(rank, init_file, *args, out_file)`` on 2 processes, forked (the children inherit the
    imported modules instead of importing them again: seconds). The worker joins the gloo group
    through ``init_file`` (``init_method=f"file://{init_file}"``) and saves what it found to
    ``f"{out_file}.{rank}"``.

    Returns:
        What each rank saved, by rank.
    """
    import torch.multiprocessing as mp

    out_file = str(folder / "results")
    mp.start_processes(worker, args=(str(folder / "init"), *args, out_file), nprocs=2, start_method="fork")
    # The test's own files, which may hold its own objects (test_gradcache's masks): not weights only.
    return [torch.load(f"{out_file}.{rank}", weights_only=False) for rank in range(2)]


@contextlib.contextmanager
def one_process_group():
    """A gloo process group of this process alone (skips when one is already up), destroyed after:
    the collectives' code paths (DDP, FSDP2, DTensor) in process, where mutmut and coverage see them."""
    import pytest

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already up")
    with tempfile.TemporaryDirectory() as root:
        torch.distributed.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}",
                                             rank=0, world_size=1)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()
