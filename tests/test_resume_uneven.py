"""A 2-rank run resumed mid-epoch after bad samples fell unevenly on its ranks (their raw-sample
counts differ) ends bit-exact with the uninterrupted run: the real CLI, 2 gloo processes,
validation on. Each rank must continue from its own raw count in the checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl
from tests.data.shard_helpers import write_shards_with_bad

GOOD = [10, 10, 10, 10]  # 40 good samples in 4 shards
BAD = {1: 4, 3: 1}  # shard -> broken JPEGs at its start: whichever rank reads shard 1 skips more
RESUME_AT = 2  # of the 5 steps of the epoch (45 raw samples, 2 ranks x batch 4)


def _shards(folder: Path) -> None:
    folder.mkdir()
    write_shards_with_bad(folder, GOOD, BAD)


def _args(tmp_path: Path, name: str, data: Path, model: str) -> list[str]:
    root = tmp_path / name
    overrides = {
        "trainer": {
            "max_epochs": 1, "log_every_n_steps": 1, "enable_progress_bar": False, "default_root_dir": str(root),
            "callbacks": [  # replaces the recipe's list (its ZeroShot needs the demo's labelled set)
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "dirpath": str(root / "steps"),
                               "filename": "{step}"}},
                {"class_path": "tests.helpers.DumpParams", "init_args": {"folder": str(root / "params")}},
            ],
        },
        "model": {"init_args": {"model_name": model, "warmup_steps": 2}},
        "data": {"init_args": {"train_data": str(data / "{00000..00003}.tar"), "val_data": str(data / "00000.tar"),
                               "batch_size": 4, "num_workers": 0, "shuffle_buffer": 4, "max_bad_fraction": 0.5,
                               "crop_scale": [0.5, 1.0], "hflip": True}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(overrides))
    return ["fit", "--config", str(REPO / "configs/demo/clip.yaml"), "--config", str(path),
            "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT]


def test_two_rank_resume_after_uneven_bad_samples_ends_bit_exact(tmp_path, tiny_clip_json):
    data = tmp_path / "shards"
    _shards(data)
    reference = tmp_path / "uninterrupted"
    out = run_mmssl(_args(tmp_path, "uninterrupted", data, tiny_clip_json), tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    [saved] = (reference / "steps").glob(f"step={RESUME_AT}*.ckpt")
    position = torch.load(saved, weights_only=True)["ImageTextDataModule"]["position"]
    assert position["raw"][0] != position["raw"][1], position["raw"]  # the uneven case under test

    out = run_mmssl([*_args(tmp_path, "resumed", data, tiny_clip_json), f"--ckpt_path={saved}"], tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    resumed = tmp_path / "resumed"
    for rank in range(2):
        got = torch.load(resumed / "params" / f"rank{rank}.pt", weights_only=True)
        want = torch.load(reference / "params" / f"rank{rank}.pt", weights_only=True)
        differ = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
        assert not differ, f"rank {rank}: parameters differ from the uninterrupted run: {differ}"
    final = [torch.load(next((root / "steps").glob("step=5*.ckpt")), weights_only=True) for root in (reference, resumed)]
    assert final[0]["ImageTextDataModule"]["position"] == final[1]["ImageTextDataModule"]["position"]
    # The epoch's validation ran after the resume step: the same figures as uninterrupted.
    assert last_metrics(resumed / "version_0") == last_metrics(reference / "version_0")
