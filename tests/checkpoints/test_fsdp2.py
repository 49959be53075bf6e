"""FSDP2 through the real CLI (configs/trainer/fsdp2_cpu.yaml, 2 gloo processes, validation on).

What users rely on: an FSDP2 run trains the weights a DDP run trains (MAE, and CLIP with its
cross-rank contrastive gather), a SIGKILL loses nothing (``--ckpt_path last`` ends bit-exactly
where the uninterrupted run ends), the sharded checkpoint resumes on another number of
processes with exactly the saved weights, and every reader takes the folder. Validation runs on
one held-out shard, so rank 1 has no batch: under FSDP2 that once needed a collective it never joined.
"""

from __future__ import annotations

import os
import pickle
import runpy
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from mmssl.checkpoints.read import UnsafeCheckpointError, read_checkpoint, read_dcp_metadata
from mmssl.checkpoints.resume import inspect_checkpoint, run_checkpoints
from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl, shared_run
from tests.tiny import TINY_MAE_FLAGS

FSDP2 = ["--config", str(REPO / "configs/trainer/fsdp2_cpu.yaml"), PG_TIMEOUT]
DDP = ["--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT]
ONE = ["--trainer.devices=1", "--trainer.strategy.init_args.data_parallel_size=1"]
def _args(recipe: str, root: Path, demo, model: list[str], steps: int) -> list[str]:
    val = f"{os.path.dirname(demo.val)}/0.tar"  # one shard: rank 1 validates nothing
    return [
        "fit", "--config", str(REPO / f"configs/demo/{recipe}.yaml"), *model,
        f"--data.init_args.demo_dir={demo.root}", f"--data.init_args.val_data={val}",
        "--data.init_args.batch_size=4", "--data.init_args.num_workers=1",
        f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
        f"--trainer.max_steps={steps}", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={root}/kept",
        "--trainer.callbacks.filename={step}",
        "--trainer.callbacks+=tests.helpers.DumpParams", f"--trainer.callbacks.folder={root}/params",
        "--trainer.callbacks+=tests.helpers.DumpStartParams", f"--trainer.callbacks.folder={root}/params",
    ]


def _last_only_args(root: Path, demo, steps: int, *extra: str) -> list[str]:
    """A 2-process FSDP2 MAE run as ``_args``'s, its callbacks replaced by ONE checkpoint, ``last.ckpt``
    at every step (an asynchronous save of another callback at the same step would wait for the write
    tests.checkpoints.test_async_save.KillDuringWrite holds), and the weights at start and end."""
    val = f"{os.path.dirname(demo.val)}/0.tar"  # one shard: rank 1 validates nothing
    last = ('[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
            '"init_args": {"save_last": true, "save_top_k": 0, "every_n_train_steps": 1}}]')
    return [
        "fit", "--config", str(REPO / "configs/demo/mae.yaml"), *TINY_MAE_FLAGS, *FSDP2,
        f"--data.init_args.demo_dir={demo.root}", f"--data.init_args.val_data={val}",
        "--data.init_args.batch_size=4", "--data.init_args.num_workers=1",
        f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
        f"--trainer.max_steps={steps}", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1", f"--trainer.callbacks={last}",
        "--trainer.callbacks+=tests.helpers.DumpParams", f"--trainer.callbacks.folder={root}/params",
        "--trainer.callbacks+=tests.helpers.DumpStartParams", f"--trainer.callbacks.folder={root}/params",
        *extra,
    ]


def fsdp2_mae_reference(tmp_path_factory, demo) -> Path:
    """The folder of ``_last_only_args``'s 4-step run, synchronous saves, run once per session: the
    uninterrupted FSDP2 run of ``mae_runs`` and the synchronous run of
    tests/checkpoints/test_async_save.py."""
    return shared_run(tmp_path_factory, lambda root: _last_only_args(root, demo, 4), timeout=240)


def _params(root: Path, name: str = "rank0.pt") -> dict[str, torch.Tensor]:
    return torch.load(root / "params" / name, weights_only=True)


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:]


def kill_and_resume(recipe: str, root: Path, demo, model: list[str], steps: int, cwd: Path, timeout: float,
                    strategy: list[str] = DDP) -> None:
    """``recipe`` on 2 ranks into ``root``, SIGKILLed at step 3 (before the end), then resumed there
    with ``--ckpt_path last`` to the end."""
    kill = ["--trainer.callbacks+=tests.helpers.KillAtStep", "--trainer.callbacks.step=3"]
    out = run_mmssl([*_args(recipe, root, demo, model, steps), *strategy, *kill], cwd, timeout=timeout, killed=True)
    assert out.returncode == -signal.SIGKILL, out.stdout[-3000:]
    assert not (root / "params" / "rank0.pt").exists()  # it never reached the end
    _ok(run_mmssl([*_args(recipe, root, demo, model, steps), *strategy, "--ckpt_path", "last"], cwd, timeout=timeout))


def assert_resumed_as_whole(whole: Path, resumed: Path) -> dict[str, torch.Tensor]:
    """Each rank of the ``resumed`` run ends on the uninterrupted run's weights bit for bit, and
    those moved from the start; returns rank 0's weights."""
    start = _params(whole, "start_rank0.pt")
    for rank in (1, 0):
        want, got = _params(whole, f"rank{rank}.pt"), _params(resumed, f"rank{rank}.pt")
        assert got.keys() == want.keys()
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], f"rank {rank}"
        assert any(not torch.equal(want[k], start[k]) for k in want), "the weights never moved"
    return want


@pytest.fixture(scope="module")
def mae_runs(tmp_path_factory, tiny_demo):
    """A 2-process FSDP2 MAE run of 4 steps (``fsdp2_mae_reference``: its callbacks are checkpoints and
    weight dumps only), the same under DDP (the recipe's callbacks, a checkpoint each step), and an
    FSDP2 run as the DDP one SIGKILLed at step 3 (its newest checkpoint: step 2) then resumed with
    --ckpt_path last."""
    tmp = tmp_path_factory.mktemp("fsdp2_mae")
    runs = {name: tmp / name for name in ("ddp", "killed")}
    runs["fsdp2"] = fsdp2_mae_reference(tmp_path_factory, tiny_demo)
    _ok(run_mmssl([*_args("mae", runs["ddp"], tiny_demo, TINY_MAE_FLAGS, 4), *DDP], tmp, timeout=240))
    kill = ["--trainer.callbacks+=tests.helpers.KillAtStep", "--trainer.callbacks.step=3"]
    killed = run_mmssl([*_args("mae", runs["killed"], tiny_demo, TINY_MAE_FLAGS, 4), *FSDP2, *kill], tmp, timeout=240,
                       killed=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-4000:]
    shutil.copytree(runs["killed"] / "kept" / "step=2.ckpt", tmp / "step2.ckpt")
    _ok(run_mmssl([*_args("mae", runs["killed"], tiny_demo, TINY_MAE_FLAGS, 4), *FSDP2, "--ckpt_path", "last"],
                  tmp, timeout=240))
    return tmp, runs


def test_fsdp2_mae_trains_as_ddp_and_a_sigkill_resumes_bit_exactly(mae_runs):
    tmp, runs = mae_runs
    fsdp2, ddp, resumed = _params(runs["fsdp2"]), _params(runs["ddp"]), _params(runs["killed"])
    assert fsdp2.keys() == ddp.keys()
    # FSDP2 reduce-scatters where DDP all-reduces: the same mean in another summation order.
    for key in fsdp2:
        torch.testing.assert_close(fsdp2[key], ddp[key], rtol=1e-4, atol=1e-5, msg=key)
    moved = [k for k in fsdp2 if not torch.equal(fsdp2[k], _params(runs["fsdp2"], "start_rank0.pt")[k])]
    assert moved, "the FSDP2 run never changed its weights"
    differ = [k for k in fsdp2 if not torch.equal(fsdp2[k], resumed[k])]
    assert not differ, f"the resumed run ends elsewhere than the uninterrupted one: {differ}"
    # Each rank ends with the same whole weights: one model, sharded, not two replicas.
    assert all(torch.equal(fsdp2[k], _params(runs["fsdp2"], "rank1.pt")[k]) for k in fsdp2)
    # Validation logged on both runs, with rank 1 holding no held-out batch.
    assert last_metrics(runs["fsdp2"] / "version_0")["val/loss"] == pytest.approx(
        last_metrics(runs["ddp"] / "version_0")["val/loss"], rel=1e-4)
    # The checkpoints are DCP folders, complete, and --ckpt_path last continued the killed run's folder.
    last = runs["killed"] / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / ".metadata").is_file() and inspect_checkpoint(str(last)) == (4, None)


@pytest.mark.parametrize("where", ["fsdp2 on 1", "fsdp2 on 3", "ddp from the folder", "fsdp2 from a ddp file"])
def test_a_checkpoint_resumes_elsewhere_with_exactly_its_weights(where, mae_runs, tiny_demo):
    """DCP reshards a folder to any number of ranks; a folder resumes under DDP (consolidated) and
    a DDP run's file under FSDP2 (scattered into the shards). The resumed run starts from the
    checkpoint's weights exactly and finishes."""
    tmp, runs = mae_runs
    source = runs["ddp"] / "kept" / "step=2.ckpt" if where.endswith("ddp file") else tmp / "step2.ckpt"
    saved = read_checkpoint(str(source))
    assert saved["global_step"] == 2 and source.is_dir() != where.endswith("ddp file")
    world = {"fsdp2 on 1": [*FSDP2, *ONE], "ddp from the folder": DDP, "fsdp2 from a ddp file": FSDP2,
             "fsdp2 on 3": [*FSDP2, "--trainer.devices=3", "--trainer.strategy.init_args.data_parallel_size=3"]}[where]
    root = tmp / where.replace(" ", "_")
    _ok(run_mmssl([*_args("mae", root, tiny_demo, TINY_MAE_FLAGS, 3), *world, "--ckpt_path", str(source)], tmp,
                  timeout=300))
    start = _params(root, "start_rank0.pt")
    differ = [k for k in saved["state_dict"] if not torch.equal(start[k], saved["state_dict"][k])]
    assert not differ, f"{where}: resumed other weights than the checkpoint's: {differ}"
    assert inspect_checkpoint(str(root / "kept" / "step=3.ckpt"))[0] == 3


def test_fsdp2_clip_trains_as_ddp_and_every_reader_takes_its_folder(tmp_path, tiny_demo, tiny_clip_json, monkeypatch):
    # SigLIP's loss (gathered text columns), FLIP's per-rank masks and GradCache's chunks at once.
    model = [f"--model.init_args.model_name={tiny_clip_json}", "--model.init_args.loss=siglip",
             "--model.init_args.image_mask_ratio=0.5", "--model.init_args.contrastive_chunk_size=2"]
    for name, strategy in (("fsdp2", FSDP2), ("ddp", DDP)):
        _ok(run_mmssl([*_args("clip", tmp_path / name, tiny_demo, model, 3), *strategy], tmp_path, timeout=240))
    fsdp2, ddp = _params(tmp_path / "fsdp2"), _params(tmp_path / "ddp")
    for key in ddp:  # logit_scale / logit_bias are (1,) in the sharded module, 0-d in open_clip's
        torch.testing.assert_close(fsdp2[key].reshape(ddp[key].shape), ddp[key], rtol=1e-4, atol=1e-5, msg=key)
    got, want = last_metrics(tmp_path / "fsdp2" / "version_0"), last_metrics(tmp_path / "ddp" / "version_0")
    for key in ("val/loss", "val/t2i_R@1", "val/zero_shot_top1"):
        assert got[key] == pytest.approx(want[key], abs=1e-4), key
    # The folder read as one checkpoint: open_clip's 0-d scalars, and the DDP run's weights.
    folder = tmp_path / "fsdp2" / "kept" / "step=3.ckpt"  # written after the last step
    checkpoint = read_checkpoint(str(folder))
    assert checkpoint["global_step"] == 3
    state = checkpoint["state_dict"]
    assert state["model.logit_scale"].shape == ()
    torch.testing.assert_close(state["model.logit_scale"], ddp["model.logit_scale"], rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(sys, "argv", ["export.py", "--ckpt", str(folder), "--format", "open_clip",
                                      "--output", str(tmp_path / "clip.pth")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "tools" / "export.py"), run_name="__main__")
    assert not exit_.value.code
    exported = torch.load(tmp_path / "clip.pth", weights_only=True)
    torch.testing.assert_close(exported["logit_scale"], ddp["model.logit_scale"], rtol=1e-4, atol=1e-5)
    # One consolidated file, which a DDP run or any tool reads as it reads their own.
    monkeypatch.setattr(sys, "argv", ["consolidate.py", "--ckpt", str(folder), "--output", str(tmp_path / "one.ckpt")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "tools" / "consolidate.py"), run_name="__main__")
    assert not exit_.value.code
    one = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert one["global_step"] == 3 and one["state_dict"].keys() == state.keys()
    assert all(torch.equal(one["state_dict"][k], state[k]) for k in state)
    optimizer = one["optimizer_states"][0]  # Optimizer.state_dict()'s numbering, every parameter's moments
    numbered = [i for group in optimizer["param_groups"] for i in group["params"]]
    assert numbered == list(range(len(numbered))) and sorted(optimizer["state"]) == numbered
    assert all(set(entry) == {"step", "exp_avg", "exp_avg_sq"} for entry in optimizer["state"].values())


def _folder(tmp_path: Path) -> Path:
    """A small DCP folder written in this process (no process group), as a sharded save lays it out."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "last.ckpt"
    dcp.save({"state_dict": {"w": torch.arange(6.0)}}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 7}, folder / "meta.pt")
    return folder


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_torn_or_crafted_folder_is_named_and_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = _folder(tmp_path)
    assert inspect_checkpoint(str(folder)) == (7, None)
    assert read_checkpoint(str(folder))["state_dict"]["w"].tolist() == list(range(6))
    shard = next(folder.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # truncated
    with pytest.raises(ValueError, match=rf"{shard.name}.*truncated"):
        read_dcp_metadata(str(folder))
    assert "incomplete sharded checkpoint" in inspect_checkpoint(str(folder))[1]
    shard.unlink()  # missing
    with pytest.raises(FileNotFoundError, match=rf"shard {shard.name}.* missing"):
        read_dcp_metadata(str(folder))
    shard.write_bytes(data)
    (folder / ".metadata").write_bytes(pickle.dumps(_Boom()))  # crafted
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*posix\.system|\.metadata.*os\.system"):
        read_checkpoint(str(folder))
    assert not (tmp_path / "pwned").exists()
    _folder(tmp_path)  # whole again, then Lightning's meta.pt crafted
    torch.save({"global_step": 7, "x": _Boom()}, folder / "meta.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"meta\.pt.*(posix|os)\.system"):
        read_checkpoint(str(folder))
    assert "UnsafeCheckpointError" in inspect_checkpoint(str(folder))[1]
    assert not (tmp_path / "pwned").exists()
    (folder / ".metadata").unlink()  # a save killed before DCP's last write
    assert not (folder / ".metadata").exists() and inspect_checkpoint(str(folder))[0] is None


def test_a_save_killed_between_its_renames_still_resumes(tmp_path):
    """The previous folder set aside under its hidden name is a resume candidate; a half-written
    folder (no .metadata, hidden .partial name) never is."""
    from mmssl.checkpoints.sharded import OLD, PARTIAL, hidden_name

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    previous = _folder(tmp_path)
    aside = hidden_name(checkpoints / "last.ckpt", OLD)
    os.rename(previous, aside)
    (hidden_name(checkpoints / "last.ckpt", PARTIAL)).mkdir()
    assert run_checkpoints(str(tmp_path)) == [str(aside)]
    assert inspect_checkpoint(str(aside)) == (7, None)


@pytest.mark.parametrize("recipe", ["coca", "classifier"])
def test_fsdp2_coca_and_the_classifier_train_as_ddp(recipe, tmp_path, tiny_demo, tiny_coca_json):
    """CoCa enters its network through ``losses`` (registered with FSDP2), the classifier is a timm
    ViT: both reach the DDP run's weights, validation on."""
    model = [f"--model.init_args.model_name={tiny_coca_json}"] if recipe == "coca" else [
        "--model.init_args.model_kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2}"]
    config = "coca" if recipe == "coca" else "../finetune/demo"
    for name, strategy in (("fsdp2", FSDP2), ("ddp", DDP)):
        _ok(run_mmssl([*_args(config, tmp_path / name, tiny_demo, model, 2), *strategy], tmp_path, timeout=240))
    fsdp2, ddp = _params(tmp_path / "fsdp2"), _params(tmp_path / "ddp")
    assert fsdp2.keys() == ddp.keys()
    for key in ddp:
        torch.testing.assert_close(fsdp2[key].reshape(ddp[key].shape), ddp[key], rtol=1e-4, atol=1e-5, msg=key)
    assert last_metrics(tmp_path / "fsdp2" / "version_0")["val/loss"] == pytest.approx(
        last_metrics(tmp_path / "ddp" / "version_0")["val/loss"], rel=1e-4)


def _save(strategy, folder: Path, step: int) -> None:
    """``FSDP2Strategy.save_checkpoint`` in one process (no process group: DCP writes one shard)."""
    strategy.save_checkpoint({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step},
                             str(folder))


def test_a_failed_sharded_save_leaves_the_previous_folder_whole_and_nothing_half_written(tmp_path, monkeypatch):
    """A full disk while the shards or meta.pt are written, and a kill between the two renames:
    the previous checkpoint stays the one `--ckpt_path last` takes, whole."""
    import errno
    import warnings

    from mmssl.checkpoints import sharded
    from mmssl.checkpoints.sharded import FSDP2Strategy

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    checkpoints = tmp_path / "checkpoints"
    last, strategy = checkpoints / "last.ckpt", FSDP2Strategy()
    _save(strategy, last, 1)
    assert inspect_checkpoint(str(last)) == (1, None)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:  # meta.pt, the last file, cannot be written
        m.setattr(sharded, "atomic_torch_save", full)
        with pytest.raises(OSError, match="No space left"):
            _save(strategy, last, 2)
    assert inspect_checkpoint(str(last)) == (1, None)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]  # no partial folder left
    assert read_checkpoint(str(last))["state_dict"]["w"].tolist() == [1.0] * 4

    def killed_after_setting_aside(src, dst):
        if str(src).endswith(sharded.PARTIAL):  # the new folder's rename: the process dies here
            raise KeyboardInterrupt
        os.replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(sharded.os, "rename", killed_after_setting_aside)
        with pytest.raises(KeyboardInterrupt):
            _save(strategy, last, 3)
    assert not last.exists()  # between the renames: the previous folder is set aside, complete
    [aside] = run_checkpoints(str(tmp_path))
    assert inspect_checkpoint(aside) == (1, None)
    _save(strategy, last, 4)  # the next save clears what the killed one left
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    assert inspect_checkpoint(str(last)) == (4, None)


def test_fsdp2_mixed_precision_with_activation_checkpointing_trains_and_evaluates(tmp_path, tiny_demo):
    """The GPU config's keys on CPU: bf16 compute, fp32 reduction, the model's grad_checkpointing.
    Validation and the health callback (which calls encode_image, a named stage) run on the
    gathered bf16 weights; the checkpoint keeps the fp32 master weights."""
    import math

    keys = ["--trainer.strategy.init_args.param_dtype=bfloat16", "--trainer.strategy.init_args.reduce_dtype=float32",
            "--model.init_args.grad_checkpointing=true"]
    _ok(run_mmssl([*_args("mae", tmp_path / "bf16", tiny_demo, TINY_MAE_FLAGS, 2), *FSDP2, *keys], tmp_path,
                  timeout=240))
    logged = last_metrics(tmp_path / "bf16" / "version_0", ("val/", "health/"))
    assert math.isfinite(logged["val/loss"]) and "health/rankme" in logged
    state = read_checkpoint(str(tmp_path / "bf16" / "kept" / "step=2.ckpt"))["state_dict"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}


_RANK_SAVES = '''
import errno, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from mmssl.checkpoints import sharded

rank, folder, fault = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=5))
strategy = sharded.FSDP2Strategy()
strategy.cluster_environment = LightningEnvironment()
strategy.cluster_environment.set_global_rank(rank)
strategy.cluster_environment.set_world_size(2)

def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

def save(step):
    strategy.save_checkpoint({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, folder)

save(1)
if rank == 0:  # rank 0 alone writes meta.pt and renames: there the disk fills, or the rename fails
    if fault == "meta":
        sharded.atomic_torch_save = full
    else:
        sharded.FSDP2Strategy._replace = staticmethod(lambda temp, path: full())
start = time.monotonic()
try:
    save(2)
except sharded.CheckpointWriteError as err:
    print(f"rank {rank} raised after {time.monotonic() - start:.1f} s: {err}", flush=True)
    dist.barrier()  # both ranks are here: the process group still works
    code = 3
else:
    code = 0
# the group is torn down before exit: gloo's threads left to the interpreter's exit once aborted a
# rank ("terminate called without an active exception", SIGABRT) after it had raised and printed
dist.destroy_process_group()
sys.exit(code)
'''


@pytest.mark.parametrize("fault", ["meta", "rename"])
def test_a_failed_write_on_rank_0_is_raised_on_every_rank_at_once(fault, tmp_path):
    """Rank 0 alone writes meta.pt and renames the folder: when that fails, every rank raises
    CheckpointWriteError naming the folder at once (the outcome is broadcast), where rank 1 once
    waited at a barrier until the process-group timeout (5 min here; the runs get 90 s)."""

    from tests.cli_runs import cli_env, free_port, run_together

    script = tmp_path / "save.py"
    script.write_text(_RANK_SAVES)
    last = tmp_path / "checkpoints" / "last.ckpt"
    env = cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = run_together([[sys.executable, str(script), str(rank), str(last), fault] for rank in (0, 1)], 90,
                        envs=[env, env])
    for rank, (code, out) in enumerate(done):
        assert code == 3, f"rank {rank}:\n{out[-3000:]}"
        assert f"rank {rank} raised" in out and str(last) in out and "No space left" in out, out[-3000:]
        assert "the previous checkpoint there is unchanged" in out
    assert inspect_checkpoint(str(last)) == (1, None)
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
