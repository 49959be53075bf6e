"""Which checkpoint a run resumes from and which folder it writes into (mmssl.checkpoints.resume),
in process: sharded folders and set-aside saves as candidates, the newest by time (not by name),
HPC-only resumes, configured checkpoint folders, the reasons a file is passed over, a folder taken
by another run between the listing and the ``mkdir``, and the plan Lightning's children inherit."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from mmssl.checkpoints.resume import (
    RUN_ENV,
    check_checkpoint,
    export_plan,
    inspect_checkpoint,
    is_global_rank_zero,
    newest_complete,
    plan_run,
    reserve_folder,
    run_checkpoints,
    slurm_job,
)


def _ckpt(path: Path, step: int, age: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.arange(4.0)}}, path)
    _age(path, age)
    return path


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def _sharded(folder: Path, step: int | None, age: float = 0.0) -> Path:
    """A DCP checkpoint folder as a sharded save writes it (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"w": torch.arange(6.0)}}, checkpoint_id=folder, no_dist=True)
    torch.save({} if step is None else {"global_step": step}, folder / "meta.pt")
    _age(folder, age)
    return folder


def test_a_sharded_folder_is_resumed_and_one_without_its_step_or_metadata_is_passed_over(tmp_path):
    ckpts = tmp_path / "version_0" / "checkpoints"
    good = _sharded(ckpts / "epoch=0-step=4.ckpt", 4, age=60)
    no_step = _sharded(ckpts / "epoch=0-step=6.ckpt", None, age=30)
    torn = _sharded(ckpts / "last.ckpt", 8)
    (torn / ".metadata").unlink()  # a save killed before DCP's last write
    assert inspect_checkpoint(str(good)) == (4, None)
    plan = plan_run(str(tmp_path), "last", env={})
    assert (plan.folder, plan.ckpt_path, plan.resume_step, plan.continued) == (
        str(tmp_path / "version_0"), str(good), 4, True)
    said = "\n".join(plan.notes)
    assert f"passed over {torn}: an incomplete sharded checkpoint (FileNotFoundError" in said
    assert f"passed over {no_step}: no global_step in its meta.pt: not a Lightning training checkpoint" in said


def test_a_save_set_aside_by_a_killed_sharded_write_is_still_a_candidate(tmp_path):
    """A kill between a sharded save's two renames leaves the previous folder under a hidden
    ``.old`` name (mmssl.checkpoints.sharded): the run resumes from it, not from step 0."""
    ckpts = tmp_path / "version_0" / "checkpoints"
    aside = _sharded(ckpts / ".last.ckpt.123.abcd.old", 5)
    (ckpts / "last.ckpt.partial").mkdir()  # the unfinished new folder: never a candidate
    plan = plan_run(str(tmp_path), "last", env={})
    assert (plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (0, str(aside), 5, True)


def test_the_newest_by_modification_time_wins_whatever_the_names(tmp_path):
    older = _ckpt(tmp_path / "last.ckpt", 9, age=60)
    newer = _ckpt(tmp_path / "epoch=1-step=3.ckpt", 3)  # sorts before "last" by name
    assert newest_complete([str(older), str(newer)]) == (str(newer), 3, [])
    # A file gone since it was listed sorts last and is passed over, named with the reason.
    gone = str(tmp_path / "gone.ckpt")
    assert newest_complete([gone]) == (None, None, [f"passed over {gone}: cannot be read (No such file or directory)"])


def test_the_reasons_a_file_is_passed_over_name_what_is_wrong_with_it(tmp_path):
    no_step = tmp_path / "weights.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, no_step)
    assert inspect_checkpoint(str(no_step)) == (None, "no global_step: not a Lightning training checkpoint")

    class Boom:
        def __reduce__(self):
            return (os.system, ("true",))

    crafted = tmp_path / "crafted.ckpt"
    torch.save({"global_step": 1, "x": Boom()}, crafted)
    step, why = inspect_checkpoint(str(crafted))
    assert step is None and why.startswith("unreadable (UnsafeCheckpointError: ")
    legacy = tmp_path / "legacy.ckpt"  # not a zip archive: read through the legacy pickle path
    torch.save({"global_step": 2}, legacy, _use_new_zipfile_serialization=False)
    assert inspect_checkpoint(str(legacy)) == (2, None)
    with pytest.raises(ValueError) as err:
        check_checkpoint(str(no_step))
    assert str(err.value) == (f"checkpoint {no_step} is no global_step: not a Lightning training checkpoint; pass "
                              "another checkpoint, or --ckpt_path last to take the newest complete one of the "
                              "run folders")


def test_hpc_resumes_only_from_lightnings_slurm_saves(tmp_path):
    run = tmp_path / "version_0"
    hpc = _ckpt(run / "hpc_ckpt_2.ckpt", 2, age=60)
    last = _ckpt(run / "checkpoints" / "last.ckpt", 7)  # newer, but not an HPC save
    shared = _ckpt(tmp_path / "shared" / "last.ckpt", 8)  # ModelCheckpoint(dirpath=...)'s, newer still
    assert sorted(run_checkpoints(str(run))) == sorted([str(hpc), str(last)])  # by default: both kinds
    assert run_checkpoints(str(run), hpc_only=True) == [str(hpc)]
    plan = plan_run(str(tmp_path), "hpc", [str(shared.parent)], env={})
    assert (plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (0, str(hpc), 2, True)
    hpc.unlink()
    with pytest.raises(ValueError, match="--ckpt_path hpc: no complete hpc_ckpt"):
        plan_run(str(tmp_path), "hpc", env={})


def test_hpc_resumes_a_sharded_slurm_save(tmp_path):
    """Under FSDP2 Lightning's SLURM save (SIGUSR1, then the requeue's ``--ckpt_path hpc``) is a DCP
    folder named hpc_ckpt_N.ckpt: it is the HPC candidate, and one without its metadata is passed over."""
    run = tmp_path / "version_0"
    hpc = _sharded(run / "hpc_ckpt_2.ckpt", 2, age=60)
    _sharded(run / "checkpoints" / "last.ckpt", 7)  # newer, but not an HPC save
    torn = _sharded(run / "hpc_ckpt_3.ckpt", 3, age=30)
    (torn / ".metadata").unlink()  # the job ended during the save
    plan = plan_run(str(tmp_path), "hpc", env={})
    assert (plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (0, str(hpc), 2, True)
    assert any(n.startswith(f"passed over {torn}: an incomplete sharded checkpoint") for n in plan.notes), plan.notes


def test_a_newer_configured_checkpoint_is_resumed_in_a_new_folder_and_each_file_passed_over_is_named_once(tmp_path):
    own = _ckpt(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 4, age=60)
    shared = _ckpt(tmp_path / "shared" / "last.ckpt", 6)  # ModelCheckpoint(dirpath=shared): newer
    plan = plan_run(str(tmp_path), "last", [str(shared.parent)], env={})
    assert (plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (1, str(shared), 6, False)
    # The configured file truncated, and the newest run folder's only file too: each is named once,
    # and the run continues the older folder's complete checkpoint.
    shared.write_bytes(shared.read_bytes()[:100])
    torn = _ckpt(tmp_path / "version_1" / "checkpoints" / "last.ckpt", 9)
    torn.write_bytes(b"")
    plan = plan_run(str(tmp_path), "last", [str(shared.parent)], env={})
    assert (plan.version, plan.ckpt_path, plan.continued) == (0, str(own), True)
    passed = [n for n in plan.notes if n.startswith("passed over")]
    assert sorted(passed) == sorted([f"passed over {shared}: truncated (100 bytes, the zip archive has no central "
                                     "directory): an interrupted write",
                                     f"passed over {torn}: empty (0 bytes): an interrupted write"])


@pytest.mark.parametrize("existing, taken, want", [
    ([], [0], 1),  # the first folder taken meanwhile
    ([0], [1], 2),  # the next one taken: the one after it, no gap
    ([0], [1, 2], 3),
])
def test_a_folder_taken_between_the_listing_and_the_mkdir_gives_the_next_free_one(tmp_path, monkeypatch, existing,
                                                                                   taken, want):
    for v in existing:
        (tmp_path / f"version_{v}").mkdir()
    real_mkdir, calls = os.mkdir, []

    def racing_mkdir(path, *args, **kwargs):
        if os.path.dirname(path) == str(tmp_path):  # a run folder, not the root (os.makedirs)
            if not calls:  # another run reserves its folders just before this one's first mkdir
                for v in taken:
                    real_mkdir(tmp_path / f"version_{v}")
            calls.append(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    assert reserve_folder(str(tmp_path), "77") == (str(tmp_path / f"version_{want}"), want)
    assert (tmp_path / f"version_{want}" / "slurm_job.txt").read_text() == "77\n"
    assert sorted(os.listdir(tmp_path)) == sorted(f"version_{v}" for v in {*existing, *taken, want})
    assert calls[0] == str(tmp_path / f"version_{taken[0]}")  # the race did happen


def test_lightnings_children_inherit_the_whole_plan_through_the_environment(tmp_path, monkeypatch):
    ckpt = _ckpt(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 3)
    plan = plan_run(str(tmp_path), "last", env={})
    monkeypatch.setenv(RUN_ENV, "")  # restored after the test
    export_plan(plan)  # default: this process's environment, which the children copy
    assert json.loads(os.environ[RUN_ENV])["ckpt_path"] == str(ckpt)
    monkeypatch.setattr(os, "getppid", lambda: os.getpid())
    child = plan_run(str(tmp_path), "last", env={RUN_ENV: os.environ[RUN_ENV], "LOCAL_RANK": "1"})
    assert (child.folder, child.version, child.ckpt_path, child.resume_step, child.continued) == (
        str(tmp_path / "version_0"), 0, str(ckpt), 3, True)


def test_a_checkpoint_given_by_path_is_checked_and_resumed_in_a_new_folder(tmp_path):
    given = _ckpt(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 4)
    plan = plan_run(str(tmp_path), str(given), env={})
    assert (plan.folder, plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (
        str(tmp_path / "version_1"), 1, str(given), 4, False)
    assert plan.notes == []  # the user named the file: nothing to tell
    # A path mmssl does not resolve (a remote URL for Lightning's fsspec): passed on unread.
    remote = plan_run(str(tmp_path), "s3://bucket/last.ckpt", env={})
    assert (remote.version, remote.ckpt_path, remote.resume_step) == (2, "s3://bucket/last.ckpt", None)


def test_validate_takes_the_last_checkpoint_but_writes_its_own_folder_without_the_job(tmp_path):
    last = _ckpt(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 6)
    (tmp_path / "version_0" / "slurm_job.txt").write_text("55\n")
    env = {"SLURM_JOB_ID": "55", "SLURM_RESTART_COUNT": "2"}  # validate never follows a requeue
    plan = plan_run(str(tmp_path), "last", fit=False, env=env)
    assert (plan.folder, plan.version, plan.ckpt_path, plan.resume_step, plan.continued) == (
        str(tmp_path / "version_1"), 1, str(last), 6, False)
    assert not (tmp_path / "version_1" / "slurm_job.txt").exists()  # a requeue of job 55 never continues it
    assert plan.notes == [f"resuming from {last} (global_step 6), in the new run folder {tmp_path / 'version_1'}"]
    fit = plan_run(str(tmp_path), "last", env={})
    assert fit.notes == [f"resuming from {last} (global_step 6), continuing {tmp_path / 'version_0'}"]


def test_last_continues_the_newest_folder_even_when_an_older_folder_saved_later(tmp_path):
    newest = _ckpt(tmp_path / "version_1" / "checkpoints" / "last.ckpt", 3, age=60)
    _ckpt(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 9)  # touched later, an older run
    plan = plan_run(str(tmp_path), "last", env={})
    assert (plan.version, plan.ckpt_path, plan.continued) == (1, str(newest), True)


def test_only_a_restart_of_the_same_job_counts_as_a_requeue(tmp_path):
    _ckpt(tmp_path / "version_0" / "hpc_ckpt_1.ckpt", 5)
    (tmp_path / "version_0" / "slurm_job.txt").write_text("9\n")
    for env in ({"SLURM_JOB_ID": "9"}, {"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "0"}):  # its first start
        plan = plan_run(str(tmp_path), None, env=env)
        assert (plan.ckpt_path, plan.continued) == (None, False) and plan.version > 0
    # A requeue with --ckpt_path hpc takes only the job's HPC saves, newest first.
    (tmp_path / "version_7").mkdir()
    (tmp_path / "version_7" / "slurm_job.txt").write_text("9\n")
    _ckpt(tmp_path / "version_7" / "checkpoints" / "last.ckpt", 8)  # not an HPC save
    hpc = plan_run(str(tmp_path), "hpc", env={"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "1"})
    assert (hpc.version, hpc.resume_step, hpc.continued) == (0, 5, True)
    # A requeue whose folders hold no complete checkpoint says which folders it looked in.
    (tmp_path / "version_0" / "hpc_ckpt_1.ckpt").write_bytes(b"")
    (tmp_path / "version_7" / "checkpoints" / "last.ckpt").unlink()
    unknown = plan_run(str(tmp_path), None, env={"SLURM_JOB_ID": "10", "SLURM_RESTART_COUNT": "1"})
    assert unknown.notes == [f"SLURM job 10 restarted, but no folder of {tmp_path} recorded it with a complete "
                             "checkpoint: starting at step 0 in a new run folder"]  # it had no folder here
    none = plan_run(str(tmp_path), "hpc", env={"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "1"})
    assert none.ckpt_path is None and none.version == 9
    assert none.notes[-1] == (f"SLURM job 9 restarted, but no folder of {tmp_path} recorded it with a complete "
                              "checkpoint: starting at step 0 in a new run folder "
                              "(its folders: version_7, version_2, version_1, version_0)")  # 1, 2: the first starts


def test_hpc_without_a_complete_save_fails_naming_the_files_passed_over(tmp_path):
    torn = tmp_path / "version_0" / "hpc_ckpt_3.ckpt"
    torn.parent.mkdir()
    torn.write_bytes(b"")
    older = _ckpt(tmp_path / "version_0" / "hpc_ckpt_2.ckpt", 2, age=60)
    older.write_bytes(b"")
    _age(older, 60)
    with pytest.raises(ValueError) as err:
        plan_run(str(tmp_path), "hpc", env={})
    assert str(err.value) == (f"--ckpt_path hpc: no complete hpc_ckpt_*.ckpt in any run folder of {tmp_path}; "
                              f"passed over {torn}: empty (0 bytes): an interrupted write; "
                              f"passed over {older}: empty (0 bytes): an interrupted write")
    plan = plan_run(str(tmp_path / "fresh"), "last", env={})
    assert plan.notes == [f"--ckpt_path last: no complete checkpoint in any run folder of {tmp_path / 'fresh'}: "
                          "starting at step 0 in a new run folder"]


def test_slurm_jobs_and_ranks_are_read_from_their_launchers_variables(tmp_path):
    assert slurm_job({"SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "7", "SLURM_JOB_ID": "101"}) == "100_7"
    assert slurm_job({"SLURM_ARRAY_JOB_ID": "100", "SLURM_JOB_ID": "101"}) == "101"  # no task: not an array task
    assert slurm_job({"SLURM_ARRAY_TASK_ID": "7", "SLURM_JOB_ID": "101"}) == "101"
    assert slurm_job({"SLURM_JOB_ID": ""}) is None
    assert not is_global_rank_zero({"RANK": "2"})  # torchrun's rank 2, LOCAL_RANK 0 on its node
    assert is_global_rank_zero({"RANK": "0"})
    # A rank that is not 0 creates nothing: it names the newest folder (rank 0's), version_0 if none yet.
    rank1 = plan_run(str(tmp_path / "root"), None, env={"RANK": "1"})
    assert (rank1.folder, rank1.version) == (str(tmp_path / "root" / "version_0"), 0)
    assert not (tmp_path / "root").exists()


def test_the_plan_reads_this_processs_environment_by_default(tmp_path, monkeypatch):
    for name in ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
                 "SLURM_RESTART_COUNT", RUN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    plan = plan_run(str(tmp_path), None)
    assert plan.folder == str(tmp_path / "version_0")
    assert (tmp_path / "version_0" / "slurm_job.txt").read_text() == "42\n"
