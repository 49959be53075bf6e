"""Asynchronous sharded saves (``FSDP2Strategy(async_mode="async")``, mmssl.checkpoints.async_save):
the step waits only for the staging copy, and the folder promise of a synchronous save holds.

In process: the copy is taken at the save (the weights may change at once), at most one write is in
flight, and a failed background write, a rank's shard or rank 0's ``meta.pt``, is raised on both
ranks of a gloo group at the same step (or at the next save) naming the folder, the previous
folder whole. Through ``mmssl fit`` on 2 gloo processes (FSDP2, validation on): the asynchronous
run ends on the synchronous run's weights and figures with the same last folder, and a SIGKILL
during a background write leaves the previous folder, which ``--ckpt_path last`` resumes
bit-exactly.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mmssl.checkpoints.read import read_checkpoint
from mmssl.checkpoints.resume import inspect_checkpoint
from tests.checkpoints.test_fsdp2 import _last_only_args as _fit
from tests.checkpoints.test_fsdp2 import _ok, _params, fsdp2_mae_reference
from tests.cli_runs import cli_env, free_port, last_metrics, run_mmssl, run_together

ASYNC = "--trainer.strategy.init_args.async_mode=async"


def _save(strategy, folder: Path, step: int, weights: torch.Tensor) -> None:
    strategy.save_checkpoint({"state_dict": {"w": weights}, "global_step": step}, str(folder))


def test_the_save_returns_with_a_copy_and_one_write_is_in_flight(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    from mmssl.checkpoints.sharded import FSDP2Strategy

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    last, strategy = tmp_path / "last.ckpt", FSDP2Strategy(async_mode="async")
    writing, release = [], __import__("threading").Event()
    original = dcp_files._FileSystemWriter.write_data

    def held(self, plan, planner):  # the background write waits until the test lets it go
        writing.append(time.monotonic())
        release.wait(30)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp_files._FileSystemWriter, "write_data", held)
    best = tmp_path / "epoch=0-step=0.ckpt"  # the previous best, which top-k clean-up removes
    best.mkdir()
    weights = torch.full((4,), 1.0)
    _save(strategy, last, 1, weights)  # returns with the write held
    strategy.remove_checkpoint(str(best))  # Lightning's, right after the new save returned
    weights.add_(100.0)  # the next step changes the weights in place: the copy was taken
    deadline = time.monotonic() + 30
    while not writing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writing and not last.exists() and strategy._async.pending_path == last.absolute()
    assert best.is_dir()  # kept until the new checkpoint is complete
    [partial] = [p for p in tmp_path.iterdir() if p != best]
    assert partial.name.startswith(".last.ckpt.") and partial.name.endswith(".partial")
    release.set()
    _save(strategy, last, 2, weights)  # waits for the first write, then starts its own
    assert read_checkpoint(str(last))["state_dict"]["w"].tolist() == [1.0] * 4 and not best.exists()
    strategy.on_train_end()  # the end of training waits for the last write
    assert inspect_checkpoint(str(last)) == (2, None)
    assert read_checkpoint(str(last))["state_dict"]["w"].tolist() == [101.0] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    strategy._async.close()  # what teardown does: the thread released


def test_a_preemption_save_is_in_place_when_it_returns(tmp_path):
    """Lightning's SLURM handler requeues the job right after its ``hpc_ckpt_N.ckpt`` save: that
    save is waited for. A file checkpoint cannot be written in the background: refused."""
    from mmssl.checkpoints.sharded import FSDP2Strategy

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    strategy = FSDP2Strategy(async_mode="async")
    _save(strategy, tmp_path / "hpc_ckpt_1.ckpt", 1, torch.ones(4))
    assert strategy._async.pending_path is None and inspect_checkpoint(str(tmp_path / "hpc_ckpt_1.ckpt")) == (1, None)
    strategy._async.close()
    with pytest.raises(ValueError, match="needs save_distributed_checkpoint: true"):
        FSDP2Strategy(async_mode="async", save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="async_mode='pinned': one of disabled, async"):
        FSDP2Strategy(async_mode="pinned")


_RANK_SAVES = '''
import errno, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_files
from lightning.fabric.plugins.environments import LightningEnvironment
from mmssl.checkpoints import sharded

rank, folder = int(sys.argv[1]), sys.argv[2]
print(f"rank {rank} started at {time.time():.1f}", flush=True)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=5))
strategy = sharded.FSDP2Strategy(async_mode="async")
strategy.cluster_environment = LightningEnvironment()
strategy.cluster_environment.set_global_rank(rank)
strategy.cluster_environment.set_world_size(2)
strategy.parallel_devices = [torch.device("cpu")] * 2
write_data, atomic_torch_save = dcp_files._FileSystemWriter.write_data, sharded.atomic_torch_save

def full(*args, **kwargs):
    time.sleep(1.0)  # the step goes on meanwhile
    raise OSError(errno.ENOSPC, "No space left on device")

def save(step):
    strategy.save_checkpoint({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, folder)

def steps():
    for step in range(200):
        try:
            strategy.on_train_batch_start(None, step)
        except sharded.CheckpointWriteError as err:
            return step, err
        time.sleep(0.05)
    return step, None

save(1)
strategy.on_train_end()
if rank == 1:  # rank 1's shard cannot be written
    dcp_files._FileSystemWriter.write_data = lambda self, plan, planner: full()
save(2)
step, err = steps()
print(f"rank {rank} raised at step {step}: {err}", flush=True)
def kept():
    return torch.load(os.path.join(folder, 'meta.pt'))['global_step']
print(f"rank {rank} kept step {kept()}", flush=True)
dcp_files._FileSystemWriter.write_data = write_data
if rank == 0:  # rank 0's meta.pt cannot be written: raised at the next save
    sharded.atomic_torch_save = full
save(3)
try:
    save(4)
except sharded.CheckpointWriteError as err:
    print(f"rank {rank} raised at the next save: {err}", flush=True)
    print(f"rank {rank} still kept step {kept()}", flush=True)
sharded.atomic_torch_save = atomic_torch_save
save(5)
strategy.on_train_end()
print(f"rank {rank} saved step {kept()}", flush=True)
strategy._async.close()
dist.destroy_process_group()
print(f"rank {rank} ended at {time.time():.1f}", flush=True)
'''


def test_a_failed_background_write_is_raised_on_every_rank_naming_the_folder(tmp_path):
    """Rank 1's shard write fails in the background: both ranks raise CheckpointWriteError naming
    the folder at the same training step; rank 0's meta.pt fails: both raise at the next save. The
    folder stays the previous complete checkpoint, and nothing half-written is left."""
    script = tmp_path / "save.py"
    script.write_text(_RANK_SAVES)
    last = tmp_path / "checkpoints" / "last.ckpt"
    env = cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = run_together([[sys.executable, str(script), str(rank), str(last)] for rank in (0, 1)], 120,
                        envs=[env, env])
    steps = set()
    for rank, (code, out) in enumerate(done):
        assert code == 0, f"rank {rank}:\n{out[-3000:]}"
        line = next((line for line in out.splitlines() if line.startswith(f"rank {rank} raised at step")), "")
        assert f"{last}: the sharded checkpoint was not saved: rank 1 could not write its shard" in line, out[-3000:]
        assert "No space left on device" in line and "the previous checkpoint there is unchanged" in line
        steps.add(int(line.split("raised at step ")[1].split(":")[0]))
        assert f"rank {rank} kept step 1" in out and f"rank {rank} still kept step 1" in out
        line = next((line for line in out.splitlines() if line.startswith(f"rank {rank} raised at the next save")), "")
        assert f"{last}: the sharded checkpoint was not saved: rank 0 could not write meta.pt" in line, out[-3000:]
        assert f"rank {rank} saved step 5" in out
    assert len(steps) == 1 and steps.pop() > 0  # the same step on both ranks; the steps went on meanwhile
    assert inspect_checkpoint(str(last)) == (5, None)
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


class KillDuringWrite(pl.Callback):
    """SIGKILL rank 0 in the background write of the save made at ``step`` (every save writes
    ``last.ckpt``), once training has gone past ``step``: its shard written, the folder not
    complete. The step returned after staging, or training could not have gone on."""

    def __init__(self, step: int) -> None:
        self.step, self.trainer = step, None

    def setup(self, trainer, pl_module, stage) -> None:
        import torch.distributed.checkpoint.filesystem as dcp_files

        self.trainer, write_data = trainer, dcp_files._FileSystemWriter.write_data
        if trainer.global_rank != 0:
            return

        def write_then_die(writer, plan, planner):
            saved_at = self.trainer.global_step  # the save's step: the loop goes on past it meanwhile
            if saved_at != self.step:
                return write_data(writer, plan, planner)
            while self.trainer.global_step <= saved_at:
                time.sleep(0.01)
            written = write_data(writer, plan, planner)
            print(f"killed at step {self.trainer.global_step} in the write of step {saved_at} to "
                  f"{Path(str(writer.path)).name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            return written

        dcp_files._FileSystemWriter.write_data = write_then_die


def test_an_async_fsdp2_run_trains_as_the_sync_one_and_a_sigkill_in_its_write_resumes_bit_exactly(
        tmp_path, tmp_path_factory, tiny_demo):
    """Synchronous saves, 4 steps (tests/checkpoints/test_fsdp2.py's FSDP2 MAE run, run once per
    session); asynchronous saves SIGKILLed in the background write of step 3's ``last.ckpt`` with
    training at step 4 (its last: the step-4 save waits for that write): ``last.ckpt`` is step 2's
    folder, whole, and the async run resumed with ``--ckpt_path last`` ends on the synchronous run's
    weights, figures and last folder, bit-exactly."""
    sync, run = fsdp2_mae_reference(tmp_path_factory, tiny_demo), tmp_path / "async"
    killed = run_mmssl(_fit(run, tiny_demo, 4, ASYNC, "--trainer.callbacks+=tests.checkpoints.test_async_save."
                            "KillDuringWrite", "--trainer.callbacks.step=3"), tmp_path, timeout=240, killed=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-4000:]
    assert "killed at step 4 in the write of step 3 to .last.ckpt." in killed.stdout, killed.stdout[-4000:]
    folder = run / "version_0" / "checkpoints"
    assert inspect_checkpoint(str(folder / "last.ckpt")) == (2, None)  # the previous folder, whole
    [partial] = [p for p in folder.iterdir() if p.name != "last.ckpt"]
    assert partial.name.endswith(".partial") and not (partial / "meta.pt").exists()
    step2 = read_checkpoint(str(folder / "last.ckpt"))["state_dict"]

    _ok(run_mmssl(_fit(run, tiny_demo, 4, ASYNC, "--ckpt_path", "last"), tmp_path, timeout=240))
    start = _params(run, "start_rank0.pt")
    assert all(torch.equal(start[k], step2[k]) for k in step2), "resumed elsewhere than step 2's folder"
    want, got = _params(sync), _params(run)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"the async run, killed and resumed, ends elsewhere than the sync run: {differ}"
    assert last_metrics(run / "version_0")["val/loss"] == last_metrics(sync / "version_0")["val/loss"]
    want_last, got_last = read_checkpoint(str(sync / "version_0" / "checkpoints" / "last.ckpt")), \
        read_checkpoint(str(folder / "last.ckpt"))
    assert got_last["global_step"] == want_last["global_step"] == 4
    for key in want_last["state_dict"]:
        assert torch.equal(got_last["state_dict"][key], want_last["state_dict"][key]), key
        assert torch.equal(got_last["state_dict"][key], got[key]), key
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]  # the killed write's folder removed
