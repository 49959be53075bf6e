"""The data stream takes the run's seed: through the CLI, two ``--seed_everything`` values give two
data orders (and crops), an explicit ``data.seed`` wins over it, and a resumed run keeps the seed
its checkpoint saved whatever the new run's seed."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mmssl.cli import main

REPO = Path(__file__).resolve().parents[2]


class FirstBatches(pl.Callback):
    """Write to ``path`` the data module's seed at the start of training and a digest of each batch
    (a file: the CLI imports this class under another module name than pytest does)."""

    def __init__(self, path: str) -> None:
        self.path, self.record = path, {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.record = {"seed": trainer.datamodule.seed, "batches": []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        image = batch["image"].contiguous().cpu()
        self.record["batches"].append(hashlib.sha256(image.numpy().tobytes()).hexdigest())
        Path(self.path).write_text(json.dumps(self.record))


@pytest.fixture
def fit(tmp_path, tiny_demo, tiny_clip_json):
    def run(name: str, *args: str) -> dict:
        record = tmp_path / f"{name}{len(list(tmp_path.glob('*.json')))}.json"
        main(
            [
                "fit",
                "--config",
                str(REPO / "configs/demo/clip.yaml"),
                "--config",
                str(REPO / "configs/demo/no_zero_shot.yaml"),
                f"--model.init_args.model_name={tiny_clip_json}",
                f"--data.init_args.demo_dir={tiny_demo.root}",
                "--data.init_args.batch_size=16",
                "--data.init_args.num_workers=0",
                # One process, and what is checked is the training stream's first batches: validation
                # would only read the held-out set, which the stream's seed does not order.
                "--trainer.limit_val_batches=0",
                "--trainer.num_sanity_val_steps=0",
                "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false",
                f"--trainer.default_root_dir={tmp_path / name}",
                "--trainer.callbacks+=tests.data.test_run_seed.FirstBatches",
                f"--trainer.callbacks.path={record}",
                *args,
            ]
        )
        return json.loads(record.read_text())

    return run


def test_the_stream_takes_the_runs_seed_and_an_explicit_data_seed_wins(fit, tmp_path):
    one = fit("one", "--seed_everything=1", "--trainer.max_steps=2")
    two = fit("two", "--seed_everything=2", "--trainer.max_steps=2")
    pinned = fit("pinned", "--seed_everything=2", "--data.init_args.seed=1", "--trainer.max_steps=2")
    assert (one["seed"], two["seed"], pinned["seed"]) == (1, 2, 1)
    assert one["batches"][0] != two["batches"][0]  # another order, or other crops
    assert pinned["batches"] == one["batches"]

    # Resumed under another run seed, the stream of the checkpoint continues, without a restart.
    ckpt = tmp_path / "one" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["ImageTextDataModule"]["seed"] == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit("one", "--seed_everything=3", "--trainer.max_steps=3", f"--ckpt_path={ckpt}")
    assert resumed["seed"] == 1 and not [w for w in caught if "data.seed" in str(w.message)]
    assert resumed["batches"][0] not in one["batches"]
