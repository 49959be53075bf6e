"""One run, one folder: reserved atomically, continued only from its own checkpoint, never rewritten otherwise."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from mmssl.checkpoints.resume import JOB_FILE, RUN_ENV, export_plan, is_global_rank_zero, plan_run, reserve_folder
from mmssl.cli import cli_main
from tests.cli_runs import cli_env
from tests.tiny import TINY_MAE

TINY_MAE_MODEL = {"class_path": "mmssl.models.mae.MAE", "init_args": TINY_MAE}


def tiny_config(tmp_path: Path, demo_root: str, max_steps: int, **trainer) -> str:
    """A YAML file for ``mmssl fit``: a 1-block MAE on the 32x32 demo set, batch 8, checkpoints
    (``last.ckpt`` and the newest step) every 2 steps, one validation batch at ``max_steps``."""
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": max_steps, "precision": "32-true", "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "limit_val_batches": 1, "val_check_interval": max_steps,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"save_last": True, "every_n_train_steps": 2}}], **trainer},
        "model": TINY_MAE_MODEL,
        "data": {"class_path": "mmssl.data.datamodule.ImageTextDataModule",
                 "init_args": {"batch_size": 8, "num_workers": 0, "demo_dir": demo_root}},
    }
    path = tmp_path / f"tiny_{max_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def loss_steps(run: Path) -> Counter:
    """How many ``train/loss`` values ``metrics.csv`` holds at each step."""
    with open(run / "metrics.csv", newline="") as file:
        return Counter(int(r["step"]) for r in csv.DictReader(file) if r.get("train/loss"))


def _ckpt(path: Path, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.arange(64.0)}}, path)
    return path


def _truncated(path: Path, source: Path) -> Path:
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_last_passes_over_truncated_and_empty_files_for_the_newest_complete_one(tmp_path):
    ckpts = tmp_path / "version_0" / "checkpoints"
    good = _ckpt(ckpts / "epoch=0-step=4.ckpt", 4)
    _age(good, 30)
    _truncated(ckpts / "last.ckpt", good)
    (ckpts / "epoch=0-step=6.ckpt").write_bytes(b"")
    plan = plan_run(str(tmp_path), "last", env={})
    assert (plan.folder, plan.ckpt_path, plan.resume_step, plan.continued) == (
        str(tmp_path / "version_0"), str(good), 4, True)
    said = "\n".join(plan.notes)
    assert f"passed over {ckpts / 'last.ckpt'}: truncated" in said and "no central directory" in said
    assert f"passed over {ckpts / 'epoch=0-step=6.ckpt'}: empty (0 bytes)" in said
    with pytest.raises(ValueError, match=r"checkpoint .*last\.ckpt is truncated"):
        plan_run(str(tmp_path), str(ckpts / "last.ckpt"), env={})  # given explicitly: an error naming it


def test_last_takes_the_newest_training_run_with_a_checkpoint_past_folders_without_one(tmp_path):
    """#44: `mmssl validate` and runs that fail at start-up reserve folders with no checkpoint;
    `--ckpt_path last` after them continues the training run, not step 0 in yet another folder."""
    last = _ckpt(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 8)
    (tmp_path / "version_1").mkdir()  # a validate run's folder: logs, no checkpoint
    (tmp_path / "version_2").mkdir()  # a run that failed at start-up
    plan = plan_run(str(tmp_path), "last", env={})
    assert (plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (0, str(last), 8, True)
    empty = tmp_path / "empty"
    (empty / "version_0").mkdir(parents=True)
    plan = plan_run(str(empty), "last", env={})
    assert (plan.version, plan.ckpt_path, plan.continued) == (1, None, False)
    assert "no complete checkpoint in any run folder" in plan.notes[0]
    # A configured ModelCheckpoint(dirpath=...) is outside every run folder: resumed in a new one.
    shared = _ckpt(tmp_path / "shared" / "last.ckpt", 3)
    plan = plan_run(str(tmp_path), "last", [str(shared.parent)], env={})
    assert (plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (3, str(shared), 3, False)


def test_a_requeue_continues_the_folder_of_its_job_and_nothing_else(tmp_path):
    mine = _ckpt(tmp_path / "version_0" / "hpc_ckpt_1.ckpt", 5)
    (tmp_path / "version_0" / JOB_FILE).write_text("100_7\n")
    _ckpt(tmp_path / "version_1" / "checkpoints" / "last.ckpt", 9)  # a later run of another job
    (tmp_path / "version_1" / JOB_FILE).write_text("200\n")
    requeued = {"SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "7", "SLURM_JOB_ID": "101",
                "SLURM_RESTART_COUNT": "1"}
    plan = plan_run(str(tmp_path), None, env=requeued)
    assert (plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (0, str(mine), 5, True)
    # The same restart count in another job's environment: a new folder, which records that job.
    other = plan_run(str(tmp_path), None, env={"SLURM_JOB_ID": "300", "SLURM_RESTART_COUNT": "1"})
    assert (other.version, other.ckpt_path, other.continued) == (2, None, False)
    assert (tmp_path / "version_2" / JOB_FILE).read_text() == "300\n"
    assert "SLURM job 300 restarted" in other.notes[0]
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT='x' is not an integer"):
        plan_run(str(tmp_path), None, env={"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "x"})


def test_only_rank_zero_reserves_and_lightnings_children_take_its_folder(tmp_path, monkeypatch):
    assert [is_global_rank_zero(e) for e in ({}, {"LOCAL_RANK": "1"}, {"NODE_RANK": "1", "LOCAL_RANK": "0"},
                                              {"RANK": "0", "LOCAL_RANK": "0"}, {"SLURM_PROCID": "3"},
                                              {"SLURM_PROCID": "0", "LOCAL_RANK": "1"})] == [
        True, False, False, True, False, False]
    assert reserve_folder(str(tmp_path)) == (str(tmp_path / "version_0"), 0)
    (tmp_path / "version_2").mkdir()  # taken by another run meanwhile
    rank1 = plan_run(str(tmp_path), None, env={"LOCAL_RANK": "1"})
    assert rank1.version == 2 and sorted(os.listdir(tmp_path)) == ["version_0", "version_2"]  # created nothing
    plan = plan_run(str(tmp_path), None, env={})
    env: dict = {}
    export_plan(plan, env)
    assert json.loads(env[RUN_ENV])["folder"] == str(tmp_path / "version_3")
    # A child of this process (as Lightning starts ranks 1..) takes the plan; any other process ignores it.
    inherited = {RUN_ENV: env[RUN_ENV].replace(str(tmp_path / "version_3"), "/theirs"), "LOCAL_RANK": "1"}
    monkeypatch.setattr(os, "getppid", lambda: os.getpid())
    assert plan_run(str(tmp_path), None, env=inherited).folder == "/theirs"
    monkeypatch.setattr(os, "getppid", lambda: 1)
    assert plan_run(str(tmp_path), None, env=inherited).folder == str(tmp_path / "version_3")  # listed instead


@pytest.mark.parametrize("trigger", ["slurm_restart", "ckpt_path_last"])
def test_a_restart_without_a_checkpoint_leaves_the_earlier_run_untouched(trigger, tmp_path, tiny_demo, monkeypatch,
                                                                          capsys):
    earlier = tmp_path / "runs" / "version_0"
    earlier.mkdir(parents=True)
    files = {"metrics.csv": "train/loss,step\n0.5,0\n0.4,1\n", "config.yaml": "earlier: 1\n", "hparams.yaml": "a: 1\n"}
    for name, text in files.items():
        (earlier / name).write_text(text)
    args = ["fit", "--config", tiny_config(tmp_path, tiny_demo.root, max_steps=2),
            f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    if trigger == "slurm_restart":  # another experiment's job, restarted once
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
    else:
        args.append("--ckpt_path=last")
    cli = cli_main(args)
    assert {name: (earlier / name).read_text() for name in files} == files
    run = tmp_path / "runs" / "version_1"
    assert cli.trainer.default_root_dir == str(run)  # Lightning's SLURM saves (hpc_ckpt_N) go there too
    assert loss_steps(run) == Counter({0: 1, 1: 1}) and yaml.safe_load((run / "config.yaml").read_text())["trainer"]
    captured = capsys.readouterr()
    assert "will be deleted" not in captured.err + captured.out  # a reserved folder is the run's own


def test_three_runs_started_together_get_three_folders(tmp_path, tiny_demo):
    root = tmp_path / "runs"
    config = tiny_config(tmp_path, tiny_demo.root, max_steps=3)
    procs = [subprocess.Popen([sys.executable, "-m", "mmssl", "fit", "--config", config, f"--seed_everything={seed}",
                               f"--trainer.default_root_dir={root}"], cwd=tmp_path, env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for seed in (1, 2, 3)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    runs = sorted(root.glob("version_*"))
    assert [r.name for r in runs] == ["version_0", "version_1", "version_2"]
    seeds = sorted(yaml.safe_load((r / "config.yaml").read_text())["seed_everything"] for r in runs)
    assert seeds == [1, 2, 3]
    for run in runs:
        assert loss_steps(run) == Counter({0: 1, 1: 1, 2: 1}), run
        assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert not [out for out in outputs if "will be deleted" in out]  # each folder is its run's own


class _Code:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("bad", ["empty", "truncated", "code"])
def test_fit_from_a_bad_checkpoint_file_fails_naming_it_before_lightning_reads_it(bad, tmp_path, tiny_demo,
                                                                               monkeypatch):
    """#44 item 11: LightningCLI reads a --ckpt_path file's hyper-parameters at parse time, and
    failed there with miniz's, EOF's or pickle's own words; mmssl's check comes first."""
    from mmssl.cli import main

    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"{bad}.ckpt"
    if bad == "empty":
        path.write_bytes(b"")
    elif bad == "truncated":
        _truncated(path, _ckpt(tmp_path / "whole.ckpt", 3))
    else:
        torch.save({"global_step": 1, "x": _Code()}, path)
    config = tiny_config(tmp_path, tiny_demo.root, max_steps=1)
    with pytest.raises(ValueError, match=rf"checkpoint {path} is .*(empty|truncated|pickles posix.system)"):
        main(["fit", "--config", config, "--ckpt_path", str(path), f"--trainer.default_root_dir={tmp_path / 'runs'}"])
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "runs").exists()
