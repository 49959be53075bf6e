"""The ``mmssl`` command: Lightning's CLI with mmssl's links and run-folder conventions.

``mmssl fit|validate|test|predict --config recipe.yaml``. Model and data classes are chosen in YAML
(``class_path``/``init_args``) or on the command line, as in any LightningCLI.
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from mmssl.callbacks.summary import RunSummary


def _image_size(model: pl.LightningModule) -> int:
    return model.image_size


def _image_mean(model: pl.LightningModule) -> tuple:
    return tuple(model.image_mean)


def _image_std(model: pl.LightningModule) -> tuple:
    return tuple(model.image_std)


def _tokenizer(model: pl.LightningModule):
    return getattr(model, "tokenizer", None)


class MMSSLCLI(LightningCLI):
    """LightningCLI whose data module takes image size, normalisation and tokenizer from the model.

    Each value lives once, on the model; ``link_arguments(apply_on="instantiate")`` hands it to
    the data module, so a recipe cannot feed 224-pixel images to a 32-pixel model.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for target, fn in (
            ("image_size", _image_size),
            ("image_mean", _image_mean),
            ("image_std", _image_std),
            ("tokenizer", _tokenizer),
        ):
            parser.link_arguments("model", f"data.init_args.{target}", compute_fn=fn, apply_on="instantiate")
        # Always on: the end-of-run report of where everything went.
        parser.add_lightning_class_args(RunSummary, "summary")

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        # One run folder for all loggers: TensorBoard and CSV each pick the next free version_N on
        # their own and can disagree, so every logger takes the first logger's version.
        if len(trainer.loggers) > 1:
            version = trainer.loggers[0].version
            for logger in trainer.loggers[1:]:
                if hasattr(logger, "_version"):
                    logger._version = version
        return trainer


def main(args: Optional[list[str]] = None) -> MMSSLCLI:
    """Entry point of the ``mmssl`` console script; ``args`` replaces ``sys.argv[1:]`` in tests."""
    return MMSSLCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
