"""The ``mmssl`` command: Lightning's CLI with mmssl's links and run-folder conventions.

``mmssl fit|validate|test|predict --config recipe.yaml``. Model and data classes are chosen in YAML
(``class_path``/``init_args``) or on the command line, as in any LightningCLI.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from mmssl.callbacks.guards import EvaluationBufferSync, NonFiniteGuard
from mmssl.callbacks.summary import RunSummary


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
        ):
            parser.link_arguments("model", f"data.init_args.{target}", compute_fn=fn, apply_on="instantiate")
        # Always on, configurable: the start/end report, and the non-finite step guard.
        parser.add_lightning_class_args(RunSummary, "summary")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite_guard")
        # Always on: no DDP buffer broadcast in evaluation forwards (ranks' batch counts differ).
        parser.add_lightning_class_args(EvaluationBufferSync, "evaluation_buffer_sync")

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        config = self._get(self.config_init, "trainer", default={})
        if config.get("logger") in (None, True) and "logger" not in kwargs:
            # Resuming (`--ckpt_path last`, or a SLURM requeue) continues in the latest run folder,
            # where its checkpoints are; a fresh run opens the next version_N.
            resume = self._get(self.config_init, "ckpt_path") in ("last", "hpc") or (
                os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")
            )
            kwargs["logger"] = default_loggers(config.get("default_root_dir") or "runs", resume)
        return super().instantiate_trainer(**kwargs)


def latest_version(root: str) -> Optional[int]:
    """Highest N of the ``version_N`` folders in ``root``, ``None`` if there is none."""
    found = [int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"version_(\d+)", d))] if os.path.isdir(root) else []
    return max(found) if found else None


def default_loggers(root: str, resume: bool = False) -> list:
    """TensorBoard and CSV loggers writing into one run folder, ``{root}/version_N``.

    Each logger would pick the next free ``version_N`` on its own, and they can disagree (the
    first creates its folder before the second looks), so the CSV logger takes TensorBoard's.
    Checkpoints and the saved config follow the first logger, so a run is one folder.

    Args:
        root: the folder of run folders (``trainer.default_root_dir``).
        resume: reuse the latest ``version_N`` (its ``checkpoints/last.ckpt`` is what
            ``--ckpt_path last`` finds) instead of opening a new one.

    Returns:
        ``[TensorBoardLogger, CSVLogger]``.
    """
    version = latest_version(root) if resume else None
    tensorboard = TensorBoardLogger(save_dir=root, name="", version=version)
    return [tensorboard, CSVLogger(save_dir=root, name="", version=tensorboard.version)]


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
    cli_main(args)


if __name__ == "__main__":
    main()
