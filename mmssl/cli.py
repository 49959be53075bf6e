"""The ``mmssl`` command: Lightning's CLI with mmssl's links and run-folder conventions.

``mmssl fit|validate|test|predict --config recipe.yaml``. Model and data classes are chosen in YAML
(``class_path``/``init_args``) or on the command line, as in any LightningCLI.
"""

from __future__ import annotations

import csv
import os
import re
import sys
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from mmssl.callbacks.guards import EvaluationBufferSync, NonFiniteGuard
from mmssl.callbacks.log_step import LogStepOnResume
from mmssl.callbacks.rng_state import RNGState
from mmssl.callbacks.summary import RunSummary
from mmssl.checkpoints import read_checkpoint
from mmssl.signals import install_sigterm_watchdog


def _image_size(model: pl.LightningModule) -> int:
    return model.image_size


def _image_mean(model: pl.LightningModule) -> tuple:
    return tuple(model.image_mean)


def _image_std(model: pl.LightningModule) -> tuple:
    return tuple(model.image_std)


def _tokenizer(model: pl.LightningModule):
    return getattr(model, "tokenizer", None)


def _trim_text_padding(model: pl.LightningModule) -> bool:
    return bool(getattr(model, "trim_text_padding", False))


def _num_classes(model: pl.LightningModule) -> Optional[int]:
    return getattr(model, "num_classes", None)  # a classifier's; labels beyond it are bad samples


class MMSSLCLI(LightningCLI):
    """LightningCLI with one run folder per run and model-to-data links.

    ``trainer.default_root_dir`` (default ``runs``) holds ``version_N`` run folders, each with the
    TensorBoard events, ``metrics.csv``, ``config.yaml`` and ``checkpoints/``, unless the config
    names its own ``trainer.logger``. The data module takes image size, normalisation and
    tokenizer from the model.

    Each value lives once, on the model; ``link_arguments(apply_on="instantiate")`` hands it to
    the data module, so a recipe cannot feed 224-pixel images to a 32-pixel model.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for target, fn in (
            ("image_size", _image_size),
            ("image_mean", _image_mean),
            ("image_std", _image_std),
            ("tokenizer", _tokenizer),
            ("trim_text_padding", _trim_text_padding),
            ("num_classes", _num_classes),
        ):
            parser.link_arguments("model", f"data.init_args.{target}", compute_fn=fn, apply_on="instantiate")
        # Always on, configurable: the start/end report, and the non-finite step guard.
        parser.add_lightning_class_args(RunSummary, "summary")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite_guard")
        # Always on: no DDP buffer broadcast in evaluation forwards (ranks' batch counts differ).
        parser.add_lightning_class_args(EvaluationBufferSync, "evaluation_buffer_sync")
        # Always on: every rank's RNG states in each checkpoint, restored on resume.
        parser.add_lightning_class_args(RNGState, "rng_state")
        # Always on: a resumed run logs at the uninterrupted run's steps (a Lightning restart quirk).
        parser.add_lightning_class_args(LogStepOnResume, "log_step_on_resume")

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        config = self._get(self.config_init, "trainer", default={})
        if config.get("logger") in (None, True) and "logger" not in kwargs:
            # Resuming (`--ckpt_path last`, or a SLURM requeue) continues in the latest run folder,
            # where its checkpoints are; a fresh run opens the next version_N.
            root = config.get("default_root_dir") or "runs"
            ckpt_path = self._get(self.config_init, "ckpt_path")
            requeued = os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")
            resume = ckpt_path in ("last", "hpc") or requeued
            resume_step = None
            if resume:
                callbacks = config.get("callbacks") or []
                callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
                dirs = [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
                found = resume_checkpoint(root, latest_version(root), "hpc" if requeued and ckpt_path is None else ckpt_path, dirs)
                resume_step = checkpoint_step(found) if found else 0  # none: Lightning starts again at 0
            kwargs["logger"] = default_loggers(root, resume, resume_step)
        trainer = super().instantiate_trainer(**kwargs)
        # LogStepOnResume first: callbacks that log in on_train_batch_start (LearningRateMonitor)
        # must see its correction of the logging step.
        trainer.callbacks.sort(key=lambda callback: not isinstance(callback, LogStepOnResume))
        return trainer


def latest_version(root: str) -> Optional[int]:
    """Highest N of the ``version_N`` folders in ``root``, ``None`` if there is none."""
    found = [int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"version_(\d+)", d))] if os.path.isdir(root) else []
    return max(found) if found else None


def resume_checkpoint(root: str, version: Optional[int], ckpt_path: Optional[str],
                      checkpoint_dirs: Sequence[str] = ()) -> Optional[str]:
    """The file Lightning resumes from for ``ckpt_path`` in mmssl's run-folder layout, if any.

    Args:
        root: ``trainer.default_root_dir``.
        version: N of the run folder ``{root}/version_N`` being continued.
        ckpt_path: ``last``: the newest ``last*.ckpt`` in ``{root}/version_N/checkpoints``
            (where ``ModelCheckpoint`` writes by default) or in ``checkpoint_dirs``, as
            Lightning picks it; ``hpc``: ``{root}/hpc_ckpt_{highest}.ckpt``, as Lightning's SLURM
            handler names them; any other value is a path, returned when it exists.
        checkpoint_dirs: ``dirpath`` of the configured ``ModelCheckpoint`` callbacks that set one.

    Returns:
        The checkpoint's path, ``None`` when there is none (Lightning then starts at step 0).
    """
    if ckpt_path == "hpc":
        found = [int(m.group(1)) for f in os.listdir(root) if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", f))] if os.path.isdir(root) else []
        return os.path.join(root, f"hpc_ckpt_{max(found)}.ckpt") if found else None
    if ckpt_path == "last":
        folders = [*checkpoint_dirs, *([os.path.join(root, f"version_{version}", "checkpoints")] if version is not None else [])]
        last = [os.path.join(d, f) for d in folders if os.path.isdir(d) for f in os.listdir(d) if re.fullmatch(r"last.*\.ckpt", f)]
        return max(last, key=os.path.getmtime) if last else None
    return ckpt_path if ckpt_path and os.path.isfile(ckpt_path) else None


def checkpoint_step(path: str) -> int:
    """``global_step`` of a Lightning checkpoint (memory-mapped: the weights are not read)."""
    return int(read_checkpoint(path, mmap=True)["global_step"])


def default_loggers(root: str, resume: bool = False, resume_step: Optional[int] = None) -> list:
    """TensorBoard and CSV loggers writing into one run folder, ``{root}/version_N``.

    Each logger would pick the next free ``version_N`` on its own, and they can disagree (the
    first creates its folder before the second looks), so the CSV logger takes TensorBoard's.
    Checkpoints and the saved config follow the first logger, so a run is one folder.

    A resumed run continues its folder's logs from the checkpoint's step: Lightning logs the
    metrics of the step that makes ``global_step`` ``k`` at step ``k - 1``, so what the killed run
    logged at steps ``>= k`` is redone, and logged again, by the resumed run. ``metrics.csv`` keeps
    its rows before ``k`` (:class:`ContinuedCSVLogger`); TensorBoard's ``purge_step=k`` hides the
    events at steps ``>= k`` of the earlier event files, so each curve is one line (checked with
    TensorBoard 2.21's Rust and Python loaders).

    Args:
        root: the folder of run folders (``trainer.default_root_dir``).
        resume: reuse the latest ``version_N`` (its ``checkpoints/last.ckpt`` is what
            ``--ckpt_path last`` finds) instead of opening a new one.
        resume_step: ``global_step`` of the checkpoint the run resumes from (0 when there is
            none: the run starts again in the same folder); ``None`` for a fresh run.

    Returns:
        ``[TensorBoardLogger, CSVLogger]``.
    """
    version = latest_version(root) if resume else None
    continued = resume and version is not None and resume_step is not None
    # Every run's events start with a SessionLog.START at its first step: TensorBoard's Python
    # loader takes a run's first START for its beginning and purges on later ones only, so a
    # fresh run writes one at 0 for the START of a resume to purge (the Rust loader purges on
    # any). On resume, no second placeholder ``hp_metric`` at step 0 (Lightning logs one per run).
    resumed = {"purge_step": resume_step, "default_hp_metric": False} if continued else {"purge_step": 0}
    tensorboard = TensorBoardLogger(save_dir=root, name="", version=version, **resumed)
    csv_logger = ContinuedCSVLogger(save_dir=root, name="", version=tensorboard.version,
                                    resume_step=resume_step if continued else None)
    return [tensorboard, csv_logger]


class _ContinuedWriter(ExperimentWriter):
    """Lightning's CSV writer, keeping the rows of ``metrics.csv`` logged before ``resume_step``.

    Lightning's writer deletes an existing ``metrics.csv``; this one rewrites it with the rows at
    steps ``< resume_step`` and appends after them. Its header becomes the known keys, so a key
    first logged after the resume rewrites the file with the union of both runs' keys.
    """

    def __init__(self, log_dir: str, resume_step: int) -> None:
        self.resume_step = resume_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:  # called by __init__ instead of deleting the file
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            keys = list(reader.fieldnames or [])
            rows = [row for row in reader if row.get("step") and int(row["step"]) < self.resume_step]
        with self._fs.open(self.metrics_file_path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        self.metrics_keys = keys


class ContinuedCSVLogger(CSVLogger):
    """``CSVLogger`` that, given ``resume_step``, continues the run folder's ``metrics.csv``.

    Args:
        resume_step: ``global_step`` of the checkpoint being resumed: rows logged at this step
            or later (by the run that was interrupted) are dropped, earlier rows kept, new rows
            appended. ``None``: a fresh log, as ``CSVLogger``.
        **kwargs: ``CSVLogger`` arguments.
    """

    def __init__(self, *args: Any, resume_step: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = (ExperimentWriter(self.log_dir) if self.resume_step is None
                                else _ContinuedWriter(self.log_dir, self.resume_step))
        return self._experiment


def cli_main(args: Optional[list[str]] = None) -> MMSSLCLI:
    """Build and run the CLI; returns it so callers (tests, tools) can reach its trainer and model."""
    return MMSSLCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"default_root_dir": "runs"},
        parser_kwargs={"prog": "mmssl", "description": "Self-supervised MAE and CLIP pretraining (Lightning CLI)."},
        args=args,
    )


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``mmssl`` console script; ``args`` replaces ``sys.argv[1:]`` in tests."""
    install_sigterm_watchdog()  # SIGTERM ends the run even when a rank is stuck in a collective
    try:
        cli_main(args)
    except RuntimeError as err:
        if re.search(r"timed? ?out|timeout", str(err), re.IGNORECASE):
            # gloo and NCCL word it differently ("Timed out waiting 300000ms", "Application
            # timeout caused pair closure", "Watchdog caught collective operation timeout").
            print("mmssl: a collective timed out (trainer.strategy.init_args.timeout): some rank stopped "
                  "taking part, or died; its own log shows why", file=sys.stderr, flush=True)
        raise


if __name__ == "__main__":
    main()
