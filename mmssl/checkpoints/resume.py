"""Which run folder a run writes into, and which checkpoint it resumes from.

A root (``trainer.default_root_dir``) holds one ``version_N`` folder per run. The rules:

- A fresh run **reserves** the next ``version_N`` with ``os.mkdir`` (atomic: of N processes
  started together each gets its own folder; one that finds the name taken tries N+1).
- A run **continues** an existing folder only when it resumes from a checkpoint of that folder:
  ``--ckpt_path last`` / ``hpc`` finding one in the latest folder, or a SLURM requeue finding one
  in the folder that recorded its job id (:data:`JOB_FILE`, written when the folder is reserved).
  Anything else (no checkpoint there, another job's folder, a checkpoint given by path or kept
  outside the run folder) gets a new folder, and nothing earlier is rewritten.
- The checkpoint resumed from is the newest one that **reads completely**
  (:func:`inspect_checkpoint`); the ones passed over are reported with the reason.

Only global rank 0 creates anything. Ranks that Lightning starts itself inherit rank 0's
decision through :data:`RUN_ENV`; ranks started by a launcher (torchrun, srun) make the same
decision from the same files, and Lightning broadcasts rank 0's folder to the checkpoints and
the saved config.
"""

from __future__ import annotations

import glob
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from mmssl.checkpoints.read import LIGHTNING_META, check_save_id, read_checkpoint
from mmssl.errors import CheckpointError

JOB_FILE = "slurm_job.txt"
RUN_ENV = "MMSSL_RUN"  # rank 0's plan, for the ranks Lightning starts as its children
_VERSION = re.compile(r"version_(\d+)")


@dataclass
class RunPlan:
    """Where a run writes and what it resumes from.

    Attributes:
        folder: the run folder, ``{root}/version_{version}``.
        version: its N.
        ckpt_path: the checkpoint to resume from (a resolved path, or the caller's own value
            when it is not a file mmssl resolves); ``None``: start at step 0.
        resume_step: ``global_step`` of ``ckpt_path`` when mmssl read it, else ``None``.
        continued: ``folder`` held an earlier run, which this one continues.
        notes: what to tell the user (checkpoints passed over and why, a new folder and why).
    """

    folder: str
    version: int
    ckpt_path: Optional[str] = None
    resume_step: Optional[int] = None
    continued: bool = False
    notes: list[str] = field(default_factory=list)


def versions(root: str) -> list[int]:
    """The N of every ``version_N`` folder in ``root``, ascending (none: ``[]``)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(root) if (m := _VERSION.fullmatch(d)))


def inspect_checkpoint(path: str) -> tuple[Optional[int], Optional[str]]:
    """``(global_step, None)`` when ``path`` reads completely, ``(None, why not)`` otherwise.

    Cheap: a zip checkpoint (``torch.save``'s format) must end in its central directory, which
    an interrupted write never reaches; its pickle is then read with the tensors memory-mapped
    (:func:`mmssl.checkpoints.read_checkpoint`), for ``global_step``. A sharded checkpoint
    folder (an FSDP2 run's) reads completely when its DCP metadata does, every shard it names is
    there at its full length, and its ``meta.pt`` holds ``global_step``.
    """
    if os.path.isdir(path):
        return _inspect_folder(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            magic = file.read(4)
    except OSError as err:
        return None, f"cannot be read ({err.strerror or err})"
    if size == 0:
        return None, "empty (0 bytes): an interrupted write"
    if magic.startswith(b"PK") and not zipfile.is_zipfile(path):
        return None, f"truncated ({size} bytes, the zip archive has no central directory): an interrupted write"
    try:
        state = read_checkpoint(path, mmap=True)
    except Exception as err:  # any failure to read is a reason to pass the file over
        return None, f"unreadable ({type(err).__name__}: {err})"
    step = state.get("global_step")
    if not isinstance(step, int):
        return None, "no global_step: not a Lightning training checkpoint"
    return step, None


def _inspect_folder(path: str) -> tuple[Optional[int], Optional[str]]:
    try:
        check_save_id(path)  # read_dcp_metadata's checks, then every shard of the save meta.pt records
        step = read_checkpoint(os.path.join(path, LIGHTNING_META), mmap=True).get("global_step")
    except Exception as err:  # any failure to read is a reason to pass the folder over
        return None, f"an incomplete sharded checkpoint ({type(err).__name__}: {err})"
    if not isinstance(step, int):
        return None, f"no global_step in its {LIGHTNING_META}: not a Lightning training checkpoint"
    return step, None


def check_checkpoint(path: str) -> int:
    """``global_step`` of the checkpoint at ``path``, or an error naming it.

    Raises:
        ValueError: the file does not read completely (truncated, empty, not a checkpoint).
    """
    step, problem = inspect_checkpoint(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is {problem}; pass another checkpoint, or --ckpt_path last "
                              "to take the newest complete one of the run folders")
    return step


def newest_complete(paths: Sequence[str]) -> tuple[Optional[str], Optional[int], list[str]]:
    """The newest (by modification time) of ``paths`` that reads completely.

    Returns:
        ``(path, global_step, passed_over)``: ``passed_over`` names each newer file skipped,
        with the reason; ``(None, None, passed_over)`` when none reads.
    """
    def mtime(path: str) -> float:
        try:
            return os.path.getmtime(path)
        except OSError:  # gone since it was listed
            return float("-inf")

    passed: list[str] = []
    for path in sorted(set(paths), key=lambda p: (mtime(p), p), reverse=True):
        step, problem = inspect_checkpoint(path)
        if problem is None:
            return path, step, passed
        passed.append(f"passed over {path}: {problem}")
    return None, None, passed


def run_checkpoints(folder: str, hpc_only: bool = False) -> list[str]:
    """The checkpoint files of a run folder: ``checkpoints/*.ckpt`` (``ModelCheckpoint``'s
    default place) and ``hpc_ckpt_*.ckpt`` (Lightning's SLURM saves, the trainer's
    ``default_root_dir`` being the run folder); ``hpc_only``: the latter alone."""
    found = glob.glob(os.path.join(glob.escape(folder), "hpc_ckpt_*.ckpt"))
    if not hpc_only:
        found += glob.glob(os.path.join(glob.escape(folder), "checkpoints", "*.ckpt"))
        # A sharded save killed between its two renames leaves the previous folder set aside
        # under a hidden name (mmssl.checkpoints.sharded): still a complete checkpoint.
        found += glob.glob(os.path.join(glob.escape(folder), "checkpoints", ".*.ckpt.*.old"))
    return [p for p in found if os.path.isfile(p) or os.path.isdir(p)]


def slurm_job(env: Mapping[str, str]) -> Optional[str]:
    """The SLURM job this process belongs to: ``ARRAYJOB_TASK`` for an array task, else the job id."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "")
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def is_global_rank_zero(env: Mapping[str, str]) -> bool:
    """Whether this process is (or will be) global rank 0, from the launchers' variables: none
    of ``RANK`` (torchrun), ``SLURM_PROCID`` (srun), ``NODE_RANK`` and ``LOCAL_RANK``
    (Lightning's own launcher, which starts ranks 1.. of each node) is set to another rank."""
    return not any(_env_int(env, name) for name in ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK"))


def reserve_folder(root: str, job: Optional[str] = None) -> tuple[str, int]:
    """Create the next free ``{root}/version_N`` atomically and record ``job`` in it.

    Returns:
        ``(folder, N)``.
    """
    os.makedirs(root, exist_ok=True)
    version = (versions(root) or [-1])[-1] + 1
    while True:
        folder = os.path.join(root, f"version_{version}")
        try:
            os.mkdir(folder)
            break
        except FileExistsError:  # another run took it between the listing and the mkdir
            version = max(version + 1, (versions(root) or [-1])[-1] + 1)
    if job:
        with open(os.path.join(folder, JOB_FILE), "w") as file:
            file.write(job + "\n")
    return folder, version


def _job_folders(root: str, job: str) -> list[int]:
    """The versions whose :data:`JOB_FILE` records ``job``, newest first."""
    found = []
    for version in reversed(versions(root)):
        try:
            with open(os.path.join(root, f"version_{version}", JOB_FILE)) as file:
                if file.read().strip() == job:
                    found.append(version)
        except OSError:
            pass
    return found


def _resume_in(root: str, candidates: list[int], extra: Sequence[str], hpc_only: bool,
               notes: list[str]) -> Optional[RunPlan]:
    """The plan continuing the first of the ``candidates`` folders that has a complete checkpoint;
    a newer complete one of ``extra`` (outside the run folders) is resumed in a new folder.
    ``None`` when none reads."""
    tried = [(v, run_checkpoints(os.path.join(root, f"version_{v}"), hpc_only)) for v in candidates]
    for i, (version, own) in enumerate(tried or [(None, [])]):
        path, step, passed = newest_complete([*own, *(extra if i == 0 else ())])
        notes += passed
        if path is not None and path in own:
            return RunPlan(os.path.join(root, f"version_{version}"), version, path, step, continued=True)
        if path is not None:
            return RunPlan("", -1, path, step)
    return None


def plan_run(root: str, ckpt_path: Optional[str], checkpoint_dirs: Sequence[str] = (), fit: bool = True,
             env: Optional[Mapping[str, str]] = None) -> RunPlan:
    """Decide the run folder and the checkpoint of a run (rank 0 reserves a new folder).

    Args:
        root: the folder of run folders.
        ckpt_path: the ``--ckpt_path`` given: ``None``, ``"last"``, ``"hpc"``, or a path
            (checked to read completely; a run from it gets a new folder).
        checkpoint_dirs: ``dirpath`` of configured ``ModelCheckpoint`` callbacks: their
            ``last*.ckpt`` are ``last`` candidates too (as Lightning picks them; such a folder
            may hold other runs' files), resumed in a new run folder.
        fit: the subcommand is ``fit`` (others never continue a folder or follow a requeue).
        env: the environment (default ``os.environ``).

    Returns:
        The :class:`RunPlan`.

    Raises:
        ValueError: a given checkpoint file does not read completely, or ``hpc`` found no
            complete HPC checkpoint.
    """
    env = os.environ if env is None else env
    rank_zero = is_global_rank_zero(env)
    if not rank_zero and (inherited := _inherited(env)) is not None:
        return inherited
    job, notes = slurm_job(env), []
    plan: Optional[RunPlan] = None
    if ckpt_path not in (None, "last", "hpc"):
        step = check_checkpoint(ckpt_path) if os.path.exists(ckpt_path) else None
        plan = RunPlan("", -1, ckpt_path, step)
    elif fit and job and (_env_int(env, "SLURM_RESTART_COUNT") or 0) > 0:
        # A requeue: the folder this job reserved, wherever it is among the root's runs.
        mine = _job_folders(root, job)
        plan = _resume_in(root, mine, (), ckpt_path == "hpc", notes)
        if plan is None:
            notes.append(f"SLURM job {job} restarted, but no folder of {root} recorded it with a complete "
                         "checkpoint: starting at step 0 in a new run folder"
                         + (f" (its folders: {', '.join(f'version_{v}' for v in mine)})" if mine else ""))
    elif ckpt_path in ("last", "hpc"):
        # Newest folder first, down to the first with a complete checkpoint: a folder without one
        # (a run that failed at start-up, or `mmssl validate`'s, which writes no checkpoint) does
        # not hide the training run before it.
        newest_first = versions(root)[::-1]
        extra = [p for d in checkpoint_dirs for p in glob.glob(os.path.join(glob.escape(d), "last*.ckpt"))]
        plan = _resume_in(root, newest_first, () if ckpt_path == "hpc" else extra, ckpt_path == "hpc", notes)
        if plan is None and ckpt_path == "hpc":
            raise CheckpointError(f"--ckpt_path hpc: no complete hpc_ckpt_*.ckpt in any run folder of {root}"
                                  + "".join(f"; {n}" for n in notes))
        if plan is None:
            notes.append(f"--ckpt_path last: no complete checkpoint in any run folder of {root}: "
                         "starting at step 0 in a new run folder")
        elif not fit:  # validate/test/predict write their own folder
            plan = RunPlan("", -1, plan.ckpt_path, plan.resume_step)
    if plan is None:
        plan = RunPlan("", -1)
    plan.notes = notes
    if not plan.folder:
        if rank_zero:
            plan.folder, plan.version = reserve_folder(root, job if fit else None)
        else:  # not created here: Lightning broadcasts rank 0's folder where files are written
            plan.version = (versions(root) or [0])[-1]
            plan.folder = os.path.join(root, f"version_{plan.version}")
    if plan.resume_step is not None and plan.ckpt_path != ckpt_path:
        where = "continuing" if plan.continued else "in the new run folder"
        notes.append(f"resuming from {plan.ckpt_path} (global_step {plan.resume_step}), {where} {plan.folder}")
    return plan


def export_plan(plan: RunPlan, env: Optional[dict] = None) -> None:
    """Hand ``plan`` to the ranks this process starts (Lightning's launcher copies the
    environment to its children); a process that is not this one's child ignores it."""
    env = os.environ if env is None else env
    env[RUN_ENV] = json.dumps({"parent": os.getpid(), "folder": plan.folder, "version": plan.version,
                               "ckpt_path": plan.ckpt_path, "resume_step": plan.resume_step,
                               "continued": plan.continued})


def _inherited(env: Mapping[str, str]) -> Optional[RunPlan]:
    try:
        saved = json.loads(env.get(RUN_ENV, ""))
    except ValueError:
        return None
    if not isinstance(saved, dict) or saved.get("parent") != os.getppid():
        return None
    return RunPlan(saved["folder"], saved["version"], saved["ckpt_path"], saved["resume_step"], saved["continued"])
