"""Preemption: a SIGKILLed run resumed with ``--ckpt_path last`` ends as if it had never stopped.

Every run goes through the real CLI. Killed runs are subprocesses (a real SIGKILL, no clean-up);
single-process references and resumes run in this process (``main([...])``) to save the ~10 s
import of a fresh interpreter. What makes the comparison strict:

- ``flip.mask_ratio=0.5``: FLIP masks come from the global torch RNG of the training process,
  so the final weights depend on :class:`~mmssl.callbacks.RNGState` restoring it (without it, the
  resumed runs here end up to 1.5e-4 and 6e-4 away from the uninterrupted run's weights).
- ``crop_scale=[0.5, 1]``, ``hflip``: random crops and flips in the loader workers, so the
  resumed workers must crop as the original ones did.
- validation after each epoch, and a checkpoint every step whose logged rows after it are dropped.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import yaml

from mmssl.callbacks.rng_state import RNGState, collect_rng_states, set_rng_states
from mmssl.cli import ContinuedCSVLogger, main, resume_checkpoint
from mmssl.data.demo import DemoData
from tests.cli_runs import cli_env, free_port, last_metrics, run_together
from tests.data.shard_helpers import write_shards_with_bad

REPO = Path(__file__).resolve().parents[2]
MICRO_CLIP = str(REPO / "configs" / "models" / "clip_micro.json")


def _launch(args: list[str], cwd: Path, timeout: float, ranks: int = 1) -> list[subprocess.CompletedProcess]:
    """``python -m mmssl ARGS`` as ``ranks`` processes started together, as a launcher would (with
    ``LOCAL_RANK`` etc. set, Lightning starts no process of its own), each in its own process
    group; all are killed if they outlive ``timeout`` seconds, so a hang fails instead of blocking
    (:func:`tests.cli_runs.run_together`: output through files, never an unread pipe)."""
    env = cli_env()
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks), NODE_RANK="0")
    command = [sys.executable, "-m", "mmssl", *args]
    try:
        done = run_together([command] * ranks, timeout, cwd=cwd,
                            envs=[{**env, **({"LOCAL_RANK": str(rank)} if ranks > 1 else {})} for rank in range(ranks)])
    except AssertionError as err:
        pytest.fail(f"mmssl {args[0]} on {ranks} process(es): {err}")
    return [subprocess.CompletedProcess(command, code, out, "") for code, out in done]


def _config(tmp_path: Path, root: Path, demo: DemoData, batch_size: int, workers: int, max_steps: int,
            tune_steps: int = 0, data: Optional[dict] = None) -> list[str]:
    """CLI arguments of the demo CLIP recipe shrunk to seconds, checkpointing every step; the
    last ``tune_steps`` steps are FLIP's unmasked tuning phase (2 warm-up steps, 1% LR). ``data``:
    data-module arguments in place of the demo's training and validation sets (zero-shot still
    scores the demo's labelled split)."""
    overrides = {
        "trainer": {
            "max_steps": max_steps, "log_every_n_steps": 1, "enable_progress_bar": False,
            "default_root_dir": str(root),
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": 0}},
                # Keeps the epoch-boundary checkpoints (8 steps an epoch on one process).
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"every_n_train_steps": 8, "save_top_k": -1, "dirpath": str(root / "boundary")}},
                # ... and the ones written after each epoch's validation (the recipes' default).
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"save_top_k": -1, "dirpath": str(root / "validated")}},
                {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                 "init_args": {"logging_interval": "step"}},  # logs in on_train_batch_start
                {"class_path": "tests.helpers.DumpParams", "init_args": {"folder": str(root / "params")}},
                # An EMA updated every 2nd step with a warm-up, validated beside the raw weights:
                # its average, update count and last update step resume exactly too.
                {"class_path": "mmssl.callbacks.EMA",
                 "init_args": {"decay": 0.8, "warmup_power": 0.75, "update_every_n_steps": 2, "evaluate": "both"}},
                {"class_path": "mmssl.callbacks.ZeroShot",  # scored for both sets of weights
                 "init_args": {"data": demo.eval_dir}},
            ],
        },
        "model": {"init_args": {"model_name": MICRO_CLIP, "warmup_steps": 2,
                                "flip": {"mask_ratio": 0.5, "unmasked_tune_steps": tune_steps,
                                         "unmasked_tune_warmup_steps": 2}}},
        "data": {"init_args": {**(data or {"demo_dir": demo.root}), "batch_size": batch_size,
                               "num_workers": workers, "crop_scale": [0.5, 1.0], "hflip": True}},
    }
    path = tmp_path / f"{root.name}.yaml"
    path.write_text(yaml.safe_dump(overrides))
    return ["fit", "--config", str(REPO / "configs/demo/clip.yaml"), "--config", str(path)]


def _kill_at(step: int) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.KillAtStep", f"--trainer.callbacks.step={step}"]


def _assert_same_params(root: Path, reference: Path, ranks: int = 1) -> None:
    """Each rank's final parameters, and its EMA's (``ema/*``, tests.helpers.DumpParams), equal the
    uninterrupted run's; under DDP every rank's EMA equals rank 0's."""
    for rank in range(ranks):
        got = torch.load(root / "params" / f"rank{rank}.pt", weights_only=True)
        want = torch.load(reference / "params" / f"rank{rank}.pt", weights_only=True)
        assert got.keys() == want.keys()
        first = torch.load(root / "params" / "rank0.pt", weights_only=True)
        assert all(torch.equal(got[k], first[k]) for k in got if k.startswith("ema/")), f"rank {rank}'s EMA"
        differ = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
        assert not differ, f"rank {rank}: parameters differ from the uninterrupted run: {differ}"


def _csv_entries(run: Path) -> Counter:
    """(step, key, value) of every logged value in ``metrics.csv``, counted."""
    with open(run / "metrics.csv", newline="") as f:
        return Counter((int(row["step"]), key, value) for row in csv.DictReader(f)
                       for key, value in row.items() if key not in ("step", "epoch") and value != "")


def _tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Each scalar tag's (step, value) events as TensorBoard's Python loader shows them
    (``--load_fast=false``; it purges on a restart's SessionLog.START only after a first one)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(run), purge_orphaned_data=True)
    events.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
            for tag in events.PluginTagToContent("scalars")}


def _assert_same_logs(run: Path, reference: Path) -> None:
    """``metrics.csv`` holds each logged value once, as in the uninterrupted run, and so does
    TensorBoard: one curve per tag, the earlier run's events after the resume step purged."""
    got, want = _csv_entries(run), _csv_entries(reference)
    assert max(got.values()) == 1, [k for k, n in got.items() if n > 1][:5]
    assert got == want, (sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5])
    assert _tensorboard_scalars(run) == _tensorboard_scalars(reference)


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_demo) -> dict:
    """An uninterrupted run and a run SIGKILLed at step 11 (8 steps an epoch: batch 3 of epoch 1).

    Steps 9-12 are FLIP's unmasked tuning phase: the killed run resumes inside it (at step 10,
    mid warm-up), the boundary copies resume at step 8 (masked) and cross into it.

    Returns ``{"args": root -> CLI args, "reference": Path, "killed": Path, "boundary": Path,
    "validated": Path}``; ``boundary`` and ``validated`` are copies of the killed run folder whose
    newest checkpoint (``last.ckpt``) is the end of epoch 0, written after its last step or after
    its validation, as if the kill had come after that checkpoint.
    """
    tmp_path = tmp_path_factory.mktemp("resume")
    torch.set_num_threads(1)  # as in the killed subprocess (OMP_NUM_THREADS=1): same float sums

    def args(root: Path) -> list[str]:  # 64 samples, batch 8: 8 steps an epoch; validation on
        return _config(tmp_path, root, tiny_demo, batch_size=8, workers=2, max_steps=13, tune_steps=4)

    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    boundary, validated = tmp_path / "boundary", tmp_path / "validated"
    main(args(reference))
    [out] = _launch([*args(killed), *_kill_at(11)], tmp_path, timeout=150)
    assert out.returncode == -signal.SIGKILL, out.stdout[-3000:]
    assert torch.load(_last(killed), weights_only=True)["global_step"] == 10  # step 11 died before its save
    for copy in (boundary, validated):
        shutil.copytree(killed, copy)
        shutil.copy(copy / copy.name / "epoch=0-step=8.ckpt", _last(copy))
    return {"args": args, "reference": reference, "killed": killed, "boundary": boundary, "validated": validated}


def _last(root: Path) -> Path:
    """The newest ``last*.ckpt`` (``last-v1.ckpt`` in a copied run folder: ModelCheckpoint keeps a
    ``last.ckpt`` it did not write), as ``--ckpt_path last`` picks it."""
    return max((root / "version_0" / "checkpoints").glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)


def _position(root: Path) -> dict:
    return torch.load(_last(root), weights_only=True)["ImageTextDataModule"]["position"]


def test_sigkilled_run_resumes_mid_epoch_exactly(single):
    killed, reference = single["killed"], single["reference"]
    main([*single["args"](killed), "--ckpt_path=last"])
    assert not (killed / "version_1").exists()  # continued in the same run folder
    ckpt = torch.load(_last(killed), weights_only=True)
    assert ckpt["global_step"] == 13 and ckpt["epoch"] == 1
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 13  # the schedule continued, not restarted
    rows = list(csv.DictReader(open(killed / "version_0" / "metrics.csv")))
    lr = {int(r["step"]): float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")}
    mask = {int(r["step"]): float(r["train/image_mask_ratio"]) for r in rows if r.get("train/image_mask_ratio")}
    peak = lr[1]  # end of the masked warm-up
    assert [lr[s] / peak for s in (9, 10, 11, 12)] == pytest.approx([0.005, 0.01, 0.01, 0.005])  # the tuning phase
    assert [mask[s] for s in range(13)] == [0.5] * 9 + [0.0] * 4
    assert _position(killed) == _position(reference)  # the data stream agrees with the step count
    _assert_same_params(killed, reference)
    _assert_same_logs(killed / "version_0", reference / "version_0")
    # WeightAveraging's layout: the EMA in state_dict, the raw weights beside it; 7 updates (steps 0, 2, .., 12).
    params = torch.load(killed / "params" / "rank0.pt", weights_only=True)
    key = "model.visual.proj"
    assert torch.equal(ckpt["state_dict"][key], params[f"ema/{key}"])
    assert torch.equal(ckpt["current_model_state"][key], params[key])
    assert int(ckpt["averaging_state"]["n_averaged"]) == 7 and ckpt["callbacks"]["EMA"]["latest_update_step"] == 13
    logged = last_metrics(reference / "version_0")
    for name in ("val/loss", "val/zero_shot_top1", "val/i2t_R@1"):
        assert name in logged and f"{name}_ema" in logged, sorted(logged)
    assert logged["val/loss"] != logged["val/loss_ema"]


def test_validate_scores_the_raw_and_averaged_weights_of_a_checkpoint_as_fit_did(single, tmp_path):
    # The checkpoint written after epoch 0's validation (step 8): `mmssl validate` with the run's
    # config (EMA evaluate: both) logs what fit logged at that validation, for both sets of weights.
    reference, root = single["reference"], tmp_path / "validate"
    args = single["args"](root)
    main(["validate", *args[1:], f"--ckpt_path={reference / 'validated' / 'epoch=0-step=8.ckpt'}"])
    with open(reference / "version_0" / "metrics.csv", newline="") as f:
        fit = {k: float(v) for row in csv.DictReader(f) if row["step"] == "7"
               for k, v in row.items() if v and k.startswith("val/")}
    got = last_metrics(root / "version_0")
    assert {"val/loss_ema", "val/zero_shot_top1_ema"} <= set(fit)
    assert got == pytest.approx(fit, rel=1e-6)


@pytest.mark.parametrize("saved", ["boundary", "validated"])
def test_sigkilled_run_resumes_at_epoch_boundary_exactly(single, saved):
    # boundary: validation of epoch 0 ran after the step-8 checkpoint and is not repeated, its rows
    # (at step 7) are kept; validated: the checkpoint came after it. Either way the killed run's
    # rows of steps 8-10 are dropped and logged again, at the same steps (LogStepOnResume).
    run, reference = single[saved], single["reference"]
    main([*single["args"](run), "--ckpt_path=last"])
    _assert_same_logs(run / "version_0", reference / "version_0")
    assert _position(run) == _position(reference)
    _assert_same_params(run, reference)


def test_two_process_run_resumes_mid_epoch_exactly_after_uneven_bad_samples(tmp_path, tiny_demo):
    # 2 ranks, loading in the training process, validation after epoch 0. 40 good samples in 4
    # shards, 4 broken JPEGs leading shard 1 and 1 leading shard 3: 45 raw samples, 5 steps an
    # epoch at batch 4 x 2 ranks, and the ranks' raw-sample counts differ mid-epoch, so each rank
    # must continue from its own count in the checkpoint.
    shards = tmp_path / "shards"
    shards.mkdir()
    write_shards_with_bad(shards, [10, 10, 10, 10], {1: 4, 3: 1})
    data = {"train_data": str(shards / "{00000..00003}.tar"), "val_data": tiny_demo.val,
            "shuffle_buffer": 4, "max_bad_fraction": 0.5}

    def args(root: Path) -> list[str]:
        return [*_config(tmp_path, root, tiny_demo, batch_size=4, workers=0, max_steps=7, data=data),
                "--config", str(REPO / "configs/trainer/ddp_cpu.yaml")]

    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    for out in _launch(args(reference), tmp_path, timeout=150, ranks=2):
        assert out.returncode == 0, out.stdout[-3000:]
    for out in _launch([*args(killed), *_kill_at(4)], tmp_path, timeout=150, ranks=2):
        assert out.returncode == -signal.SIGKILL, out.stdout[-3000:]
    ckpt = torch.load(_last(killed), weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["callbacks"]["RNGState"]["torch"].shape[0] == 2  # both ranks'
    raw = ckpt["ImageTextDataModule"]["position"]["raw"]
    assert raw[0] != raw[1], raw  # the uneven case under test
    for out in _launch([*args(killed), "--ckpt_path=last"], tmp_path, timeout=150, ranks=2):
        assert out.returncode == 0, out.stdout[-3000:]
    assert _position(killed) == _position(reference)
    _assert_same_params(killed, reference, ranks=2)
    # Every logged value once, as uninterrupted: epoch 0's validation (raw and EMA) ran after the resume.
    _assert_same_logs(killed / "version_0", reference / "version_0")
    assert {"val/loss", "val/loss_ema", "val/zero_shot_top1_ema"} <= set(last_metrics(killed / "version_0"))


class _Trainer:
    """The attributes of a trainer that RNGState reads on resume."""

    def __init__(self, world_size: int, global_rank: int, global_step: int = 10) -> None:
        self.world_size, self.global_rank, self.global_step = world_size, global_rank, global_step
        self.strategy = SimpleNamespace(root_device=torch.device("cpu"))


def test_rng_state_restores_this_ranks_stream():
    callback = RNGState()
    torch.manual_seed(1)
    rank0 = collect_rng_states()
    torch.manual_seed(2)
    rank1 = collect_rng_states()
    want = torch.rand(3)
    saved = {name: torch.stack([rank0[name], rank1[name]]) for name in rank0}
    callback.load_state_dict(saved)
    torch.manual_seed(3)
    callback.on_train_start(_Trainer(world_size=2, global_rank=1), None)
    assert torch.equal(torch.rand(3), want)


def test_rng_state_on_another_world_size_warns_and_reseeds_deterministically():
    torch.manual_seed(0)
    saved = {name: state.unsqueeze(0) for name, state in collect_rng_states().items()}
    draws = []
    for _ in range(2):
        callback = RNGState()
        callback.load_state_dict(saved)
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match="random states of 1 ranks, this run has 2"):
            callback.on_train_start(_Trainer(world_size=2, global_rank=1), None)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])


def test_collected_states_round_trip_python_and_numpy():
    import random

    import numpy as np

    states = collect_rng_states()
    want = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1))
    set_rng_states(states)
    assert (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1)) == want


def test_continued_csv_keeps_rows_before_the_resume_step_and_unites_headers(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    (run / "metrics.csv").write_text("a,step\n1.0,0\n2.0,1\n3.0,2\n4.0,3\n")  # killed at step 3
    logger = ContinuedCSVLogger(save_dir=tmp_path, name="", version=0, resume_step=2)
    logger.log_metrics({"a": 5.0}, step=2)
    logger.log_metrics({"b": 6.0}, step=3)  # a key the first run never logged
    logger.save()
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [
        ("0", "1.0", ""),
        ("1", "2.0", ""),
        ("2", "5.0", ""),
        ("3", "", "6.0"),
    ]


def test_last_checkpoint_is_the_newest_in_the_run_folder_or_a_configured_dirpath(tmp_path):
    own, custom = tmp_path / "version_3" / "checkpoints", tmp_path / "elsewhere"
    for folder, name, mtime in ((own, "last.ckpt", 1), (custom, "last-v1.ckpt", 2), (custom, "epoch=1.ckpt", 3)):
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": mtime}, folder / name)  # complete files: --ckpt_path last passes over others
        os.utime(folder / name, (mtime, mtime))
    assert resume_checkpoint(str(tmp_path), 3, "last") == str(own / "last.ckpt")
    assert resume_checkpoint(str(tmp_path), 3, "last", [str(custom)]) == str(custom / "last-v1.ckpt")
    assert resume_checkpoint(str(tmp_path), None, "hpc") is None
