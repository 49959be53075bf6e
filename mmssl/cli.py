"""The ``mmssl`` command: Lightning's CLI with mmssl's links and run-folder conventions.

``mmssl fit|validate|test|predict --config recipe.yaml``. Model and data classes are chosen in YAML
(``class_path``/``init_args``) or on the command line, as in any LightningCLI.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import re
import sys
import warnings
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import yaml
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

from mmssl.callbacks.epoch_progress import UnfinishedEpoch
from mmssl.callbacks.guards import EvaluationBufferSync, NonFiniteGuard
from mmssl.callbacks.log_step import LogStepOnResume
from mmssl.callbacks.rng_state import RNGState
from mmssl.callbacks.summary import RunSummary
from mmssl.callbacks.watchdog import Watchdog
from mmssl.checkpoints.layouts import KINDS
from mmssl.checkpoints.read import LIGHTNING_META, read_checkpoint
from mmssl.checkpoints.resume import (
    RUN_ENV,
    check_checkpoint,
    export_plan,
    is_global_rank_zero,
    newest_complete,
    plan_run,
    run_checkpoints,
    versions,
)
from mmssl.checkpoints.sharded import SafeCheckpointIO, is_sharded_checkpoint
from mmssl.commands import dispatch
from mmssl.renames import model_renames, renamed_args, upgrade_command_line
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


def _teacher_tokenizer(model: pl.LightningModule):
    return getattr(model, "teacher_text_tokenizer", None)  # a distillation teacher's, when it differs


def _teacher_embeddings(model: pl.LightningModule) -> Optional[str]:
    return getattr(model, "teacher_embeddings", None)


def _num_classes(model: pl.LightningModule) -> Optional[int]:
    return getattr(model, "num_classes", None)  # a classifier's; labels beyond it are bad samples


# Callbacks every run has, each a config group of its own (``--nonfinite_guard.max_consecutive``).
ALWAYS_ON = {
    "summary": RunSummary,  # the start/end report
    "nonfinite_guard": NonFiniteGuard,  # the non-finite step guard
    "evaluation_buffer_sync": EvaluationBufferSync,  # no DDP buffer broadcast in evaluation forwards (uneven batches)
    "rng_state": RNGState,  # every rank's RNG states in each checkpoint, restored on resume
    "log_step_on_resume": LogStepOnResume,  # a resumed run logs at the uninterrupted run's steps (a Lightning quirk)
    "unfinished_epoch": UnfinishedEpoch,  # a run stopped inside an epoch resumes inside it (a Lightning quirk)
    "watchdog": Watchdog,  # a hang names the late rank and dumps every stack; a failed rank ends the others
}


class MMSSLCLI(LightningCLI):
    """LightningCLI with one run folder per run and model-to-data links.

    ``trainer.default_root_dir`` (default ``runs``) holds ``version_N`` run folders, each with the
    TensorBoard events, ``metrics.csv``, ``config.yaml`` and ``checkpoints/``, unless the config
    names its own ``trainer.logger``. A fresh run reserves a new folder; ``--ckpt_path last`` or a
    SLURM requeue continues one only from that folder's own newest complete checkpoint
    (:func:`mmssl.checkpoints.resume.plan_run`). Checkpoints are replaced atomically
    (:class:`mmssl.checkpoints.io.AtomicCheckpointIO`). The data module takes image size, normalisation and
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
            ("teacher_tokenizer", _teacher_tokenizer),
            ("teacher_embeddings", _teacher_embeddings),
        ):
            parser.link_arguments("model", f"data.init_args.{target}", compute_fn=fn, apply_on="instantiate")
        for key, callback in ALWAYS_ON.items():
            parser.add_lightning_class_args(callback, key)

    def __init__(self, *args: Any, sigterm_watchdog: bool = False, **kwargs: Any) -> None:
        self.sigterm_watchdog = sigterm_watchdog  # read in before_instantiate_classes, during __init__
        try:
            super().__init__(*args, **kwargs)
        finally:
            if kwargs.get("run", True):
                # The run (and the ranks Lightning started for it) is over: a rank started later
                # by this process, for another run, must not take this run's folder.
                os.environ.pop(RUN_ENV, None)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None or isinstance(args, (list, tuple)):
            # Saved config.yaml files and command lines of earlier runs, keys renamed since (mmssl.renames).
            renames = model_renames(kind.class_path for kind in KINDS)
            sections = {key: renamed_args(callback) for key, callback in ALWAYS_ON.items()}
            given = list(sys.argv[1:] if args is None else args)
            upgraded = upgrade_command_line(given, renames, _read_yaml, yaml.safe_dump, sections)
            upgraded = merge_objective_flags(parser, upgraded)
            if args is None:
                # LightningCLI reads sys.argv itself (and warns when given both); the ranks it starts
                # read it too, so they parse the same upgraded command line.
                sys.argv[1:] = upgraded
            else:
                args = upgraded
        super().parse_arguments(parser, args)
        # LightningCLI then reads the checkpoint's hyper-parameters with a bare torch.load: a
        # truncated, empty or code-bearing file would fail there with miniz's, pickle's or EOF's
        # own words. Checked first, through the one reader, with an error naming the file.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if isinstance(ckpt_path, str) and os.path.isfile(ckpt_path):
            check_checkpoint(ckpt_path)
        elif isinstance(ckpt_path, str) and is_sharded_checkpoint(ckpt_path):
            self._apply_folder_hyper_parameters(str(subcommand), ckpt_path)

    def _apply_folder_hyper_parameters(self, subcommand: str, folder: str) -> None:
        """The model's init arguments of a checkpoint folder's ``meta.pt`` over the command line's,
        as LightningCLI applies a checkpoint file's (``hyper_parameters``, its ``_class_path``
        the model's class): it reads files only, so ``validate`` or ``fit`` from an FSDP2 run's
        folder ran with the recipe's values (another ``image_mean``: other figures than training's)."""
        meta = os.path.join(folder, LIGHTNING_META)
        if not os.path.isfile(meta):
            return  # refused, naming the file, where the folder is loaded
        hparams = dict(read_checkpoint(meta).get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def before_instantiate_classes(self) -> None:
        # After parsing, so that `--help` and `--print_config` work whatever the environment holds.
        if self.sigterm_watchdog:
            install_sigterm_watchdog()  # SIGTERM ends the run even when a rank is stuck in a collective

    def _subcommand_value(self, config: Any, key: str, default: Any = None) -> Any:
        """``config``'s ``key`` under this subcommand (``config`` itself without one), as LightningCLI reads it."""
        return config.get(str(self.subcommand), config).get(key, default)

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        config = self._subcommand_value(self.config_init, "trainer", {})
        ckpt_path = self._subcommand_value(self.config_init, "ckpt_path")
        if config.get("logger") in (None, True) and "logger" not in kwargs:
            root = config.get("default_root_dir") or "runs"
            callbacks = config.get("callbacks") or []
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            dirs = [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
            plan = plan_run(root, ckpt_path, dirs, fit=self.subcommand == "fit")
            if is_global_rank_zero(os.environ):
                for note in plan.notes:
                    print(f"mmssl: {note}", file=sys.stderr, flush=True)
            export_plan(plan)
            if plan.ckpt_path != ckpt_path:
                self.config_init.get(str(self.subcommand), self.config_init)["ckpt_path"] = plan.ckpt_path
            kwargs["logger"] = default_loggers(root, plan.version, plan.resume_step if plan.continued else None)
            # Lightning's SLURM handler saves hpc_ckpt_N.ckpt into default_root_dir, and on SLURM
            # resumes from the newest one there by itself: the run folder keeps them to its run.
            kwargs["default_root_dir"] = plan.folder
        elif isinstance(ckpt_path, str) and os.path.exists(ckpt_path):
            check_checkpoint(ckpt_path)  # a truncated file is named, not a bare EOFError
        _safe_model_parallel(config, self._subcommand_value(self.config, "trainer", {}), kwargs)
        trainer = super().instantiate_trainer(**kwargs)
        if not _configured_checkpoint_io(config, self._subcommand_value(self.config, "trainer", {})) and \
                type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = SafeCheckpointIO()
        # LogStepOnResume first: callbacks that log in on_train_batch_start (LearningRateMonitor)
        # must see its correction of the logging step.
        trainer.callbacks.sort(key=lambda callback: not isinstance(callback, LogStepOnResume))
        return trainer


_OBJECTIVE_FLAG = re.compile(r"--model\.(?:init_args\.)?objectives\.([A-Za-z_]\w*)\.([A-Za-z_][\w.]*)$")
_OBJECTIVES_WHOLE = re.compile(r"--model\.(?:init_args\.)?objectives(?:\.([A-Za-z_]\w*))?$")


def objective_flags(args: Sequence[str]) -> dict[int, tuple[str, list[str], str]]:
    """The command line's flags that set one option of one objective (``--model.init_args.
    objectives.NAME.KEY=VALUE`` or ``... VALUE``; ``init_args.`` may be left out), by position:
    ``{index: (NAME, KEY's parts, VALUE)}``, the value's own argument included when it is separate.
    A flag followed later by one giving NAME's (or every objective's) whole mapping is not listed:
    that one replaces it."""
    found: dict[int, tuple[str, list[str], str]] = {}
    skip: set[int] = set()
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        whole = _OBJECTIVES_WHOLE.match(flag)
        if whole:  # NAME's mapping (or all of them) given whole: earlier one-option flags give way
            for j in [j for j, (name, _, _) in found.items() if whole.group(1) in (None, name)]:
                found.pop(j)
                skip.discard(j + 1)
            continue
        match = _OBJECTIVE_FLAG.match(flag)
        if match and (eq or i + 1 < len(args)):
            found[i] = (match.group(1), match.group(2).split("."), value if eq else args[i + 1])
            if not eq:
                skip.add(i + 1)
    return {**found, **{j: found[j - 1] for j in skip if j - 1 in found}}


def merge_objective_flags(parser: Any, args: list[str]) -> list[str]:
    """The command line with each ``--model.init_args.objectives.NAME.KEY=VALUE`` merged into NAME's
    options from the configs, given as NAME's whole mapping (``--model.init_args.objectives.NAME=
    {...}``, at the place of NAME's last such flag).

    jsonargparse would set NAME's mapping to ``{KEY: VALUE}``, dropping what the configs gave NAME
    (its weight, head sizes): the run would train with defaults the user never chose. The configs'
    options are read by parsing the command line without these flags (and without
    ``--print_config``), so ``--print_config`` and the ranks Lightning starts see the merged
    mapping. Options not of NAME and later whole-mapping flags are untouched.
    """
    flags = objective_flags(args)
    if not flags:
        return args
    base_args = [a for i, a in enumerate(args) if i not in flags and not a.startswith("--print_config")]
    base = parser.parse_args(base_args)
    init = base[base["subcommand"]].model.init_args
    merged = {name: dict(options or {}) for name, options in (init.get("objectives") or {}).items()}
    last: dict[str, int] = {}
    for index in sorted(flags):
        if not args[index].startswith("--"):
            continue  # a separate value
        name, path, value = flags[index]
        options = merged[name] = dict(merged.get(name) or {})
        *parents, leaf = path
        for key in parents:
            options = options.setdefault(key, {})
        options[leaf] = yaml.safe_load(value)
        last[name] = index
    place = {index: name for name, index in last.items()}
    out = []
    for i, arg in enumerate(args):
        if i in place:
            out.append(f"--model.init_args.objectives.{place[i]}={json.dumps(merged[place[i]])}")
        elif i not in flags:
            out.append(arg)
    return out


def _read_yaml(path: str) -> Any:
    """A ``--config`` file's parsed YAML; ``None`` for a value that is no file (LightningCLI reports it)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def _safe_model_parallel(trainer_init: Any, trainer_config: Any, kwargs: dict) -> None:
    """Lightning's ``ModelParallelStrategy`` named in a config runs as mmssl's
    :class:`~mmssl.checkpoints.sharded.FSDP2Strategy`, with the same arguments: its checkpoint
    folders are replaced atomically and read as data (Lightning's are written in place and
    unpickled with ``weights_only=False``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from mmssl.checkpoints.sharded import FSDP2Strategy

    strategy, configured = trainer_init.get("strategy"), trainer_config.get("strategy")
    if type(strategy) is not ModelParallelStrategy or "strategy" in kwargs:
        return
    init_args = dict(configured.get("init_args") or {}) if hasattr(configured, "get") else {}
    kwargs["strategy"] = FSDP2Strategy(**{k: v for k, v in init_args.items() if v is not None})


def _configured_checkpoint_io(trainer_init: Any, trainer_config: Any) -> bool:
    """Whether the config names a ``CheckpointIO``: in ``trainer.plugins`` or as the strategy's
    ``checkpoint_io`` (such a choice wins over mmssl's :class:`AtomicCheckpointIO`)."""
    plugins = trainer_init.get("plugins") or []
    if any(isinstance(p, CheckpointIO) for p in (plugins if isinstance(plugins, list) else [plugins])):
        return True
    strategy = trainer_config.get("strategy")
    init_args = strategy.get("init_args") if hasattr(strategy, "get") else None
    return bool(init_args is not None and init_args.get("checkpoint_io"))


def latest_version(root: str) -> Optional[int]:
    """Highest N of the ``version_N`` folders in ``root``, ``None`` if there is none."""
    found = versions(root)
    return found[-1] if found else None


def resume_checkpoint(root: str, version: Optional[int], ckpt_path: Optional[str],
                      checkpoint_dirs: Sequence[str] = ()) -> Optional[str]:
    """The file a run resumes from for ``ckpt_path`` in mmssl's run-folder layout, if any.

    Args:
        root: ``trainer.default_root_dir``.
        version: N of the run folder ``{root}/version_N`` looked in.
        ckpt_path: ``last``: the newest complete checkpoint of ``{root}/version_N`` (its
            ``checkpoints/`` and ``hpc_ckpt_*.ckpt``) or ``last*.ckpt`` of ``checkpoint_dirs``; ``hpc``: the
            newest complete ``{root}/version_N/hpc_ckpt_*.ckpt``; any other value is a path,
            returned when it exists.
        checkpoint_dirs: ``dirpath`` of the configured ``ModelCheckpoint`` callbacks that set one.

    Returns:
        The checkpoint's path, ``None`` when there is none (Lightning then starts at step 0).
    """
    if ckpt_path not in ("last", "hpc"):
        return ckpt_path if ckpt_path and os.path.exists(ckpt_path) else None
    folder = os.path.join(root, f"version_{version}")
    found = run_checkpoints(folder, hpc_only=ckpt_path == "hpc") if version is not None else []
    if ckpt_path == "last":
        found += [os.path.join(d, f) for d in checkpoint_dirs if os.path.isdir(d) for f in os.listdir(d)
                  if re.fullmatch(r"last.*\.ckpt", f)]
    return newest_complete(found)[0]


def default_loggers(root: str, version: int, resume_step: Optional[int] = None) -> list:
    """TensorBoard and CSV loggers writing into one run folder, ``{root}/version_{version}``.

    The folder is chosen (reserved, or continued) by :func:`mmssl.checkpoints.resume.plan_run`;
    checkpoints and the saved config follow the first logger, so a run is one folder.

    A resumed run continues its folder's logs from the checkpoint's step: Lightning logs the
    metrics of the step that makes ``global_step`` ``k`` at step ``k - 1``, so what the killed run
    logged at steps ``>= k`` is redone, and logged again, by the resumed run. ``metrics.csv`` keeps
    its rows before ``k`` (:class:`ContinuedCSVLogger`); TensorBoard's ``purge_step=k`` hides the
    events at steps ``>= k`` of the earlier event files, so each curve is one line (checked with
    TensorBoard 2.21's Rust and Python loaders).

    Args:
        root: the folder of run folders (``trainer.default_root_dir``).
        version: N of the run folder.
        resume_step: ``global_step`` of the checkpoint of this folder the run resumes from;
            ``None`` for a run starting in a new folder.

    Returns:
        ``[TensorBoardLogger, CSVLogger]``.
    """
    continued = resume_step is not None
    # Every run's events start with a SessionLog.START at its first step: TensorBoard's Python
    # loader takes a run's first START for its beginning and purges on later ones only, so a
    # fresh run writes one at 0 for the START of a resume to purge (the Rust loader purges on
    # any). On resume, no second placeholder ``hp_metric`` at step 0 (Lightning logs one per run).
    resumed = {"purge_step": resume_step, "default_hp_metric": False} if continued else {"purge_step": 0}
    tensorboard = TensorBoardLogger(save_dir=root, name="", version=version, **resumed)
    csv_logger = ContinuedCSVLogger(save_dir=root, name="", version=version, resume_step=resume_step)
    return [tensorboard, csv_logger]


class ContinuedCSVLogger(CSVLogger):
    """``CSVLogger`` that, given ``resume_step``, continues the run folder's ``metrics.csv``.

    Lightning's writer warns that a non-empty folder's logs "will be deleted" and deletes an
    existing ``metrics.csv`` when it opens. A fresh run's folder is its own (reserved empty), so
    the warning is silenced and a ``metrics.csv`` found there is refused; given ``resume_step``
    the rows at steps ``< resume_step`` are read first and written back as the writer's first rows
    (its header is the union of the keys, as Lightning's writer keeps it).

    Args:
        resume_step: ``global_step`` of the checkpoint being resumed: rows logged at this step
            or later (by the run that was interrupted) are dropped, earlier rows kept, new rows
            appended. ``None``: a fresh log in a folder without one (an existing
            ``metrics.csv`` is an error, not deleted).
        **kwargs: ``CSVLogger`` arguments.
    """

    def __init__(self, *args: Any, resume_step: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step
        self._writer_opened = False

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._writer_opened:
            return super().experiment
        fs, path = get_filesystem(self.log_dir), os.path.join(self.log_dir, ExperimentWriter.NAME_METRICS_FILE)
        rows: list[dict[str, str]] = []
        if fs.isfile(path):
            if self.resume_step is None:
                raise FileExistsError(f"{path} exists: a run that does not resume from this "
                                      "folder's checkpoint does not overwrite its logs")
            with fs.open(path, "r", newline="") as file:
                rows = [row for row in csv.DictReader(file) if row.get("step") and int(row["step"]) < self.resume_step]
        with warnings.catch_warnings():  # "... will be deleted": the kept rows are written back below
            warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
            writer = super().experiment
        self._writer_opened = True
        if rows:
            writer.metrics.extend(rows)
            writer.save()
        return writer


def cli_main(args: Optional[list[str]] = None, sigterm_watchdog: bool = False) -> MMSSLCLI:
    """Build and run the CLI; returns it so callers (tests, tools) can reach its trainer and model.

    Args:
        args: the command line (default ``sys.argv[1:]``).
        sigterm_watchdog: install :func:`mmssl.signals.install_sigterm_watchdog` once the
            command line is parsed (``main`` does).
    """
    return MMSSLCLI(
        sigterm_watchdog=sigterm_watchdog,
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"default_root_dir": "runs"},
        parser_kwargs={"prog": "mmssl", "description": "Self-supervised MAE and CLIP pretraining (Lightning CLI)."},
        args=args,
    )


# The errnos of a write that found no room (ENOSPC, EDQUOT) or no write access to the medium (EROFS).
OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``mmssl`` console script; ``args`` replaces ``sys.argv[1:]`` in tests.

    A tool or ``mmssl configs`` runs and exits here (:func:`mmssl.commands.dispatch`); a run goes on
    to LightningCLI with each ``--config`` recipe name resolved to its file.
    """
    args = dispatch(args)
    try:
        cli_main(args, sigterm_watchdog=True)
    except OSError as err:
        if err.errno not in OUT_OF_ROOM:
            raise
        # A full disk or quota, a read-only mount: the write that failed names its file and says
        # the previous one is whole (mmssl.checkpoints.io); one line, not a traceback.
        print(f"mmssl: {err.strerror or err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except RuntimeError as err:
        if re.search(r"timed? ?out|timeout", str(err), re.IGNORECASE):
            # gloo and NCCL word it differently ("Timed out waiting 300000ms", "Application
            # timeout caused pair closure", "Watchdog caught collective operation timeout").
            print("mmssl: a collective timed out (trainer.strategy.init_args.timeout): some rank stopped "
                  "taking part, or died; its own log shows why", file=sys.stderr, flush=True)
        raise


if __name__ == "__main__":
    main()
