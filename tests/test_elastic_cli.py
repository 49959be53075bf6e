"""Elastic mid-epoch resume through the real CLI: 2 gloo ranks SIGKILLed mid-epoch, resumed on 1.

Every sample's ``cls`` label is its global index, and a callback in the runs records the labels of
each batch given to the model. The samples trained before the checkpoint, those the resumed run
trains and those the elastic plan reports as left out must be the epoch, each exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl

from tests.cli_runs import REPO, cli_env, free_port, run_together

SHARDS = [16, 16, 16, 16, 16, 15]  # 95 samples: neither 2 x 4 nor 1 x 4 divides what is read
BATCH, BATCH2 = 4, 3  # run 1, run 2 (run 1 leaves a multiple of 8 to read: batch 3 leaves some out)


class RecordLabels(pl.Callback):
    """Append ``[global_step, rank, labels]`` of each training batch to ``{folder}/{tag}_rank{R}.jsonl``."""

    def __init__(self, folder: str, tag: str) -> None:
        self.folder, self.tag = folder, tag

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        os.makedirs(self.folder, exist_ok=True)
        row = [trainer.global_step, trainer.global_rank, [int(x) for x in batch["label"]]]
        with open(os.path.join(self.folder, f"{self.tag}_rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def _launch(args: list[str], cwd: Path, timeout: float, ranks: int) -> list[tuple[int, str]]:
    """``python -m mmssl ARGS`` as ``ranks`` processes started together, as a launcher would (so a
    rank's SIGKILL is its own), each in its own process group, all killed after ``timeout`` s
    (:func:`tests.cli_runs.run_together`). Returns (return code, output) per rank."""
    import pytest

    env = cli_env()
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks), NODE_RANK="0")
    try:
        return run_together([[sys.executable, "-m", "mmssl", *args]] * ranks, timeout, cwd=cwd,
                            envs=[{**env, **({"LOCAL_RANK": str(rank)} if ranks > 1 else {})} for rank in range(ranks)])
    except AssertionError as err:
        pytest.fail(f"mmssl on {ranks} process(es): {err}")


def _args(root: Path, data: Path, model: str, workers: int, batch: int, tag: str) -> list[str]:
    overrides = {
        "trainer": {
            "max_epochs": 1, "log_every_n_steps": 1, "enable_progress_bar": False, "default_root_dir": str(root),
            "callbacks": [  # replaces the recipe's list (its ZeroShot needs the demo's labelled set)
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": 0}},
                {"class_path": "tests.test_elastic_cli.RecordLabels",
                 "init_args": {"folder": str(root / "labels"), "tag": tag}},
            ],
        },
        "model": {"init_args": {"model_name": model, "warmup_steps": 2}},
        "data": {"init_args": {"train_data": str(data / "{00000..00005}.tar"), "val_data": str(data / "00000.tar"),
                               "batch_size": batch, "num_workers": workers, "shuffle_buffer": 8}},
    }
    path = root.parent / f"{tag}.json"
    path.write_text(json.dumps(overrides))
    return ["fit", "--config", str(REPO / "configs/demo/clip.yaml"), "--config", str(path)]


def _rows(root: Path, tag: str) -> list[tuple[int, int, list[int]]]:
    rows = []
    for path in sorted((root / "labels").glob(f"{tag}_rank*.jsonl")):
        rows += [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return rows


def test_two_rank_run_killed_mid_epoch_finishes_the_epoch_elastically_on_one(tmp_path, tiny_clip_json):
    import torch

    from mmssl.data.plan import Topology, fresh_base, split_base
    from tests.data.shard_helpers import write_dataset

    data, root = tmp_path / "shards", tmp_path / "run"
    epoch = set(write_dataset(data, SHARDS))
    root.mkdir()

    # Run 1: 2 ranks x 2 workers x batch 4 (11 steps an epoch), killed at the end of step 5
    # (global_step 5), before that step's checkpoint: last.ckpt is at global_step 4.
    kill = ["--trainer.callbacks+=tests.helpers.KillAtStep", "--trainer.callbacks.step=5"]
    args1 = [*_args(root, data, tiny_clip_json, workers=2, batch=BATCH, tag="run1"),
             "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), "--trainer.strategy.init_args.timeout=0:01:00"]
    for rank, (code, out) in enumerate(_launch([*args1, *kill], tmp_path, timeout=120, ranks=2)):
        assert code == -signal.SIGKILL, f"rank {rank}: {out[-3000:]}"
    [last] = (root / "version_0" / "checkpoints").glob("last*.ckpt")
    ckpt = torch.load(last, weights_only=True)
    k = ckpt["global_step"]
    position = ckpt["ImageTextDataModule"]["position"]
    assert 0 < k < 11 and ckpt["epoch"] == 0
    assert position["topology"]["world"] == 2 and sum(position["batches"]) == k and len(position["raw"]) == 2

    # Run 2: 1 process, 1 worker, batch 3, the same run folder, from last.ckpt.
    args2 = _args(root, data, tiny_clip_json, workers=1, batch=BATCH2, tag="run2")
    [(code, out)] = _launch([*args2, "--ckpt_path=last"], tmp_path, timeout=120, ranks=1)
    assert code == 0 and "`Trainer.fit` stopped" in out, out[-3000:]
    assert not (root / "version_1").exists()  # continued in the same run folder
    plan = re.search(r"elastic resume of epoch 0 from 2 ranks x 2 workers x batch 4 to 1 x 1 x 3: (\d+) samples "
                     r"remain, (\d+) batches per rank read (\d+) of them, (\d+) are left out", out)
    assert plan, out[-3000:]
    remain, batches, read, left_out = map(int, plan.groups())

    run1 = _rows(root, "run1")
    assert {r for _, r, _ in run1} == {0, 1} and max(s for s, _, _ in run1) >= k
    consumed = [label for step, _, labels in run1 if step < k for label in labels]
    run2 = _rows(root, "run2")
    assert run2 and sorted(s for s, _, _ in run2) == list(range(k, k + batches))  # one batch a step, from k
    trained = [label for _, _, labels in run2 for label in labels]
    assert len(consumed) == 2 * k * BATCH and len(trained) == batches * BATCH2 == read

    both = consumed + trained
    twice = sorted({x for x in both if both.count(x) > 1})
    assert not twice, (f"read twice: {twice}; run 1 steps < {k}: "
                       f"{[(s, r, ids) for s, r, ids in run1 if s < k and set(ids) & set(twice)]}; "
                       f"run 2: {[(s, ids) for s, _, ids in run2 if set(ids) & set(twice)]}")
    missing = epoch - set(both)
    # Run 1's plan left the tail of its epoch base out (fewer than 2 x 4); the elastic plan deals
    # the unconsumed rest of run 1's plan over 1 x 1 x 3 and leaves out fewer than 1 x 3 more.
    base = fresh_base(SHARDS, ckpt["ImageTextDataModule"].get("seed", 0), 0)
    first = split_base(base, Topology(**position["topology"]))
    ids = [sum(SHARDS[:shard]) + offset for piece in base for shard, offset in piece.ids()]
    left_out_first = set(ids[len(ids) - first.left_out:])
    assert first.left_out < 2 * BATCH and remain == len(epoch) - first.left_out - len(consumed)
    assert left_out_first <= missing  # none of run 1's left-out samples was read
    assert 0 < left_out == remain - read < 1 * BATCH2
    assert len(missing) == first.left_out + left_out < 2 * BATCH + 1 * BATCH2, sorted(missing)
    resumed = torch.load(next((root / "version_0" / "checkpoints").glob("last*.ckpt")), weights_only=True)
    assert resumed["global_step"] == k + batches and resumed["ImageTextDataModule"]["position"]["history"]
