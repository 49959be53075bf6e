"""Resume and sharded-checkpoint defects of issue #55, each pinned where it lived.

- a checkpoint replacing one of the other kind (a file over a sharded folder: an FSDP2 run resumed
  on one device; a folder over a file) replaces it atomically, as any other save does;
- a save killed mid-write leaves a hidden ``.partial`` folder that the next save removes, when no
  live writer owns it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mmssl.checkpoints.io import OLD, PARTIAL, atomic_torch_save, hidden_name, writer_alive
from mmssl.checkpoints.resume import inspect_checkpoint, run_checkpoints


def _folder_save(path: Path, step: int) -> None:
    """``FSDP2Strategy.save_checkpoint`` in one process (no process group: DCP writes one shard)."""
    from mmssl.checkpoints.sharded import FSDP2Strategy

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    FSDP2Strategy().save_checkpoint({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step},
                                    str(path))


def _file_save(path: Path, step: int) -> None:
    atomic_torch_save({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, str(path))


@pytest.mark.parametrize("first, then", [(_folder_save, _file_save), (_file_save, _folder_save)],
                         ids=["file over folder", "folder over file"])
def test_a_checkpoint_replaces_one_of_the_other_kind(first, then, tmp_path):
    """An FSDP2 run's last.ckpt folder resumed on one device is replaced by a file (it once failed
    every save with "Is a directory"), and a folder replaces a DDP run's file; nothing is left beside."""
    checkpoints = tmp_path / "checkpoints"
    last = checkpoints / "last.ckpt"
    first(last, 1)
    then(last, 2)
    assert inspect_checkpoint(str(last)) == (2, None)
    assert last.is_dir() == (then is _folder_save)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize("first, then", [(_folder_save, _file_save), (_file_save, _folder_save)],
                         ids=["file over folder", "folder over file"])
def test_a_kill_between_the_renames_leaves_the_previous_checkpoint_a_resume_candidate(first, then, tmp_path,
                                                                                    monkeypatch):
    """Across kinds the previous checkpoint is set aside before the new one takes its name: a kill
    in between leaves it whole, listed for --ckpt_path last, and the next save removes it."""
    checkpoints = tmp_path / "checkpoints"
    last = checkpoints / "last.ckpt"
    first(last, 1)
    rename = os.rename

    def killed_after_setting_aside(src, dst):
        if str(dst) == str(last):  # the new checkpoint's rename: the process dies here
            raise KeyboardInterrupt
        rename(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "rename", killed_after_setting_aside)
        with pytest.raises(KeyboardInterrupt):
            then(last, 2)
    [aside] = run_checkpoints(str(tmp_path))
    assert Path(aside).name.endswith(OLD) and inspect_checkpoint(aside) == (1, None)
    then(last, 3)
    assert inspect_checkpoint(str(last)) == (3, None)
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.endswith(".tmp")) == ["last.ckpt"]


def test_a_save_removes_partial_folders_that_no_live_writer_owns(tmp_path):
    """A kill mid-save leaves a hidden half-written folder (a checkpoint's worth of shards): the
    next save of the same target removes it; one whose writer is alive (another process here, or
    another host's) is left alone, and so are other targets'."""
    checkpoints = tmp_path / "checkpoints"
    last = checkpoints / "last.ckpt"
    _folder_save(last, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    killed = last.with_name(hidden_name(last, PARTIAL).name.replace(f".{os.getpid()}.", f".{pid}."))
    live = last.with_name(hidden_name(last, PARTIAL).name.replace(f".{os.getpid()}.", f".{os.getppid()}."))
    remote = last.with_name(".last.ckpt.otherhost.1.0a0b0c0d" + PARTIAL)
    other = hidden_name(checkpoints / "epoch=0-step=1.ckpt", PARTIAL).with_name(
        killed.name.replace("last.ckpt", "epoch=0-step=1.ckpt"))
    for folder in (killed, live, remote, other):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x" * 1024)
    assert not writer_alive(killed) and writer_alive(live) and writer_alive(remote)
    _folder_save(last, 2)
    assert not killed.exists() and live.exists() and remote.exists() and other.exists()
    assert inspect_checkpoint(str(last)) == (2, None)


def test_partial_folders_named_before_the_host_was_added_are_this_hosts(tmp_path):
    """Folders that kills left before the hidden name carried the host (``.last.ckpt.<pid>.<hex>.partial``)
    were read as another host's ("ckpt" taken for a host name) and never removed: they are this
    host's, removed once their process is dead, kept while it lives."""
    checkpoints = tmp_path / "checkpoints"
    last = checkpoints / "last.ckpt"
    _folder_save(last, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = checkpoints / f".last.ckpt.{int(dead.stdout)}.0a0b0c0d{PARTIAL}"
    step = checkpoints / f".epoch=0-step=1.ckpt.{int(dead.stdout)}.0a0b0c0e{PARTIAL}"
    live = checkpoints / f".last.ckpt.{os.getppid()}.0a0b0c0f{PARTIAL}"
    for folder in (killed, step, live):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x" * 1024)
    assert not writer_alive(killed) and not writer_alive(step) and writer_alive(live)
    assert not writer_alive(checkpoints / f".last.ckpt.{os.getpid()}.0a0b0c0d{PARTIAL}")  # this process
    _folder_save(last, 2)
    assert not killed.exists() and live.exists() and step.exists()  # another target's: its own save removes it
    assert inspect_checkpoint(str(last)) == (2, None)


def _mae_args(root: Path, demo, steps: int, *extra: str) -> list[str]:
    """The demo MAE recipe at TINY_MAE's size on the tiny demo set: 16 steps an epoch on one process."""
    from tests.cli_runs import REPO
    from tests.tiny import TINY_MAE_FLAGS

    return ["fit", "--config", str(REPO / "configs/demo/mae.yaml"), *TINY_MAE_FLAGS,
            f"--data.init_args.demo_dir={demo.root}", "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=0", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=1",
            f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}", "--trainer.max_epochs=2",
            "--trainer.callbacks+=tests.helpers.DumpParams", f"--trainer.callbacks.folder={root}/params", *extra]


def test_training_longer_from_a_run_stopped_at_max_steps_continues_its_epoch(tmp_path, tiny_demo):
    """`--trainer.max_steps 2`, then 3, then 4, each `--ckpt_path last` (max_epochs 2, 16 steps an
    epoch): every run trains on from where the last stopped, inside epoch 0. Each stop once counted
    epoch 0 as ended (the save is in on_train_epoch_end): the second run trained the rest of epoch
    0 as epoch 1, and the third found max_epochs=2 reached and trained nothing."""
    from mmssl.checkpoints.read import read_checkpoint
    from tests.cli_runs import run_one_process

    seen = []
    for steps in (2, 3, 4):
        run_one_process([*_mae_args(tmp_path, tiny_demo, steps), "--ckpt_path", "last"])
        last = read_checkpoint(str(tmp_path / "version_0" / "checkpoints" / "last.ckpt"))
        seen.append((last["global_step"], last["epoch"]))
    assert seen == [(2, 0), (3, 0), (4, 0)]  # (global_step, epoch) after each run
    progress = last["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert progress == {"ready": 1, "started": 1, "processed": 0, "completed": 0}  # epoch 0 under way


RUN_MEAN, RUN_STD = (0.25, 0.5, 0.75), (0.2, 0.3, 0.4)  # not the recipe's (ImageNet's): the run's own


@pytest.fixture(scope="module")
def one_process_fsdp2_folder(tmp_path_factory, tiny_demo):
    """A 2-step FSDP2 MAE run on one process, given only `--trainer.devices=1` over fsdp2_cpu.yaml,
    trained with its own image_mean / image_std: its last.ckpt folder."""
    from tests.cli_runs import PG_TIMEOUT, REPO, run_mmssl

    root = tmp_path_factory.mktemp("fsdp2_one")
    args = [*_mae_args(root, tiny_demo, 2), "--config", str(REPO / "configs/trainer/fsdp2_cpu.yaml"), PG_TIMEOUT,
            "--trainer.devices=1", f"--model.init_args.image_mean={list(RUN_MEAN)}",
            f"--model.init_args.image_std={list(RUN_STD)}"]
    proc = run_mmssl(args, root, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return root / "version_0" / "checkpoints" / "last.ckpt"


def test_fsdp2_data_parallel_size_follows_the_world_size(one_process_fsdp2_folder):
    """fsdp2_cpu.yaml on one process with `--trainer.devices=1` alone: it once fixed
    data_parallel_size 2 and failed ("... multiplied should equal the world size (1)")."""
    assert one_process_fsdp2_folder.is_dir() and inspect_checkpoint(str(one_process_fsdp2_folder)) == (2, None)


def test_validate_from_a_folder_runs_with_the_runs_settings(one_process_fsdp2_folder, tmp_path, tiny_demo):
    """`mmssl validate --ckpt_path <folder>` builds the model with the run's hyper-parameters, as
    from a file (LightningCLI applies a file's only): the folder and its consolidated file give the
    same val/loss, with the run's image_mean / image_std, not the recipe's."""
    from mmssl.checkpoints.read import read_checkpoint
    from mmssl.cli import cli_main
    from tests.cli_runs import last_metrics

    consolidated = tmp_path / "consolidated.ckpt"
    torch.save(read_checkpoint(str(one_process_fsdp2_folder)), consolidated)
    losses = {}
    for name, ckpt in (("folder", one_process_fsdp2_folder), ("file", consolidated)):
        args = _mae_args(tmp_path / name, tiny_demo, 2)[1:-2]  # no fit, no DumpParams
        cli = cli_main(["validate", *args, "--ckpt_path", str(ckpt)])
        assert (tuple(cli.model.image_mean), tuple(cli.model.image_std)) == (RUN_MEAN, RUN_STD), name
        losses[name] = last_metrics(tmp_path / name / "version_0")["val/loss"]
    assert losses["folder"] == losses["file"]


@pytest.mark.parametrize("tool", ["consolidate.py", "export.py"])
def test_a_folder_without_meta_is_refused_in_one_line_naming_it(tool, tmp_path, monkeypatch, capsys):
    """A folder without meta.pt (the run's step, loops, hyper-parameters): `mmssl export` built a
    default ViT-B-32 and died in a 100-line size-mismatch traceback, `mmssl consolidate` wrote
    `global_step None` without a word. Both refuse in one line naming the folder and meta.pt."""
    from tests.cli_runs import run_tool

    folder = tmp_path / "last.ckpt"
    _folder_save(folder, 1)
    (folder / "meta.pt").unlink()
    output = tmp_path / "out.pth"
    extra = ["--format", "timm"] if tool == "export.py" else []
    assert run_tool(tool, ["--ckpt", str(folder), *extra, "--output", str(output)], monkeypatch) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(folder) in err and "meta.pt" in err, err
    assert not output.exists()


@pytest.mark.parametrize("loader", ["load_encoder", "load_model", "read_checkpoint"])
def test_the_one_reader_refuses_a_folder_without_meta_for_every_caller(loader, tmp_path):
    """The refusal lives in the reader (read_dcp_folder): the evaluation loader (mmssl probe,
    zero-shot, evaluate) and load_model (masked-words) read such a folder's weights alone into a
    default model before; now every caller gets the one line naming the folder and meta.pt."""
    from mmssl.checkpoints.read import read_checkpoint
    from mmssl.evaluation.encoders import load_encoder, load_model

    folder = tmp_path / "last.ckpt"
    _folder_save(folder, 1)
    (folder / "meta.pt").unlink()
    read = {"load_encoder": load_encoder, "load_model": load_model, "read_checkpoint": read_checkpoint}[loader]
    with pytest.raises(FileNotFoundError) as err:
        read(str(folder))
    message = str(err.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"{folder}: ") and "meta.pt" in message, message


def test_a_shard_of_another_save_is_refused_naming_the_folder_and_the_shard(tmp_path, monkeypatch, capsys):
    """Two saves of the same size: a shard copied from one into the other once read without a word
    (consolidate mixed two runs' weights, fit --ckpt_path resumed them). Each save records its id in
    meta.pt and in every rank's shard; a folder whose shard holds another id is refused, naming it."""
    from mmssl.checkpoints.sharded import SafeCheckpointIO
    from tests.cli_runs import run_tool

    mine, other = tmp_path / "mine" / "last.ckpt", tmp_path / "other" / "last.ckpt"
    _folder_save(mine, 1)
    _folder_save(other, 1)
    assert inspect_checkpoint(str(mine)) == (1, None)
    [shard] = [p.name for p in mine.iterdir() if p.suffix == ".distcp"]
    (mine / shard).write_bytes((other / shard).read_bytes())
    step, why = inspect_checkpoint(str(mine))  # --ckpt_path last passes it over
    assert step is None and shard in why and "another checkpoint" in why
    with pytest.raises(ValueError, match=f"{mine}: shard {shard} is not of this checkpoint's save"):
        SafeCheckpointIO().load_checkpoint(str(mine))  # a resume from the folder
    output = tmp_path / "full.ckpt"
    assert run_tool("consolidate.py", ["--ckpt", str(mine), "--output", str(output)], monkeypatch) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(mine) in err and shard in err, err
    assert not output.exists()
