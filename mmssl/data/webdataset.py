"""The data module's old import path: configs, saved ``config.yaml`` files and checkpoints written
before it moved name ``mmssl.data.webdataset.ImageTextDataModule``; they still load. New code and
configs name :mod:`mmssl.data.datamodule` (a module named after the package it imports misled
readers and tools)."""

from mmssl.data.datamodule import ImageTextDataModule

__all__ = ["ImageTextDataModule"]
