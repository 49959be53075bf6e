"""configs/demo/clip_muon.yaml (Muon with its AdamW fallback, per-tower layer decay) through the
real CLI, validation on: 2 gloo ranks train what one process trains, and a run resumed on 2 ranks
from a checkpoint of step 2 ends with the uninterrupted run's weights and optimizer state, bit for bit.

As tests.cli_runs.lockstep_runs: an 8-sample training set, 4 per rank on 2 ranks and 8 in one
process, so every epoch is one global batch of the same 8 samples and both runs take the same
steps; here with the recipe's own optimizer (Muon) instead of SGD. The two runs' gradients differ
by float32 summation order only, but Muon's Newton-Schulz runs in bfloat16 (timm's default) and
amplifies the small singular directions of a tiny batch's low-rank gradient: a 1e-7 relative change
of the input moves its output by ~2% (1e-4 in float32). So the weights are compared by how far each
tensor travelled from its start: within 5% of that distance (measured: at most 2.7%). A lost
layer scale or a rank-dependent one moves a tensor by tens of percent of its distance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl, run_one_process

STEPS = 4  # one global batch an epoch
PEAK = 1e-3  # the recipe's lr


def _args(here: Path, demo, tiny_clip_json: str, processes: int) -> list[str]:
    ddp = ["--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT] if processes == 2 else []
    return [
        "fit", "--config", str(REPO / "configs/demo/clip_muon.yaml"), *ddp,
        f"--model.init_args.model_name={tiny_clip_json}", "--model.init_args.warmup_steps=1",
        '--model.init_args.layer_decay={"image": 0.9, "text": 0.5}',  # one block each: 1, d, d^2
        f"--data.init_args.demo_dir={demo.root}", f"--data.init_args.batch_size={8 // processes}",
        "--data.init_args.num_workers=0",
        f"--trainer.max_steps={STEPS}", f"--trainer.max_epochs={STEPS}", "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=1.0", f"--trainer.check_val_every_n_epoch={STEPS}",
        f"--trainer.default_root_dir={here / 'runs'}", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
        f"--trainer.callbacks.dirpath={here / 'kept'}", "--trainer.callbacks.filename={step}",
        "--trainer.callbacks+=tests.helpers.DumpParams", f"--trainer.callbacks.folder={here / 'params'}",
        "--trainer.callbacks+=tests.helpers.DumpStartParams", f"--trainer.callbacks.folder={here / 'params'}",
    ]


def _two_ranks(args: list[str], here: Path) -> None:
    out = run_mmssl(args, here, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "world_size=2" in out.stdout and "global_batch_size=8" in out.stdout


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor and number of a nested optimizer state, by path."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _tensors(value, f"{prefix}/{i}").items()}
    return {prefix: tree if isinstance(tree, torch.Tensor) else torch.tensor(tree)} if isinstance(
        tree, (torch.Tensor, int, float, bool)) else {}


def test_muon_with_layer_decay_two_ranks_train_as_one_and_resume_bit_exactly(tmp_path, tiny_clip_json):
    from mmssl.data.demo import ensure_demo_data

    demo = ensure_demo_data(str(tmp_path / "demo"), num_train=8, num_val=16, shard_size=8, image_size=32)
    two, one, resumed = tmp_path / "p2", tmp_path / "p1", tmp_path / "resumed"
    for here in (two, one, resumed):
        here.mkdir()
    _two_ranks(_args(two, demo, tiny_clip_json, 2), two)
    run_one_process(_args(one, demo, tiny_clip_json, 1))

    # The groups: each at the recipe's peak x its tower layer's scale, Muon's and AdamW's apart.
    final = torch.load(two / "kept" / f"step={STEPS}.ckpt", weights_only=True)
    groups = final["optimizer_states"][0]["param_groups"]
    assert sorted({round(g["lr_scale"], 9) for g in groups}) == [0.25, 0.5, 0.81, 0.9, 1.0]
    assert {g.get("use_fallback", False) for g in groups} == {True, False}
    for g in groups:
        assert g["initial_lr"] == pytest.approx(PEAK * g["lr_scale"])
        assert g["lr"] / g["initial_lr"] == pytest.approx(groups[0]["lr"] / groups[0]["initial_lr"])
    routed = {s["use_muon"] for s in final["optimizer_states"][0]["state"].values()}
    assert routed == {True, False}

    params = {p: torch.load(here / "params" / "rank0.pt", weights_only=True) for p, here in ((2, two), (1, one))}
    for name, value in torch.load(two / "params" / "rank1.pt", weights_only=True).items():
        torch.testing.assert_close(value, params[2][name], rtol=0, atol=0, msg=name)  # the ranks agree
    start = torch.load(one / "params" / "start_rank0.pt", weights_only=True)
    for name, value in params[1].items():
        if torch.equal(value, start[name]):  # a buffer (the text tower's attention mask)
            assert torch.equal(params[2][name], value), name
            continue
        travelled = (value - start[name]).norm()
        assert (params[2][name] - value).norm() <= 0.05 * travelled, name
    two_val, one_val = (last_metrics(here / "runs" / "version_0", ("val/",)) for here in (two, one))
    # Whole-set figures (val/loss is in-batch: 4 vs 8 negatives), over 16 held-out samples.
    for key in ("val/zero_shot_top1", "val/i2t_R@1", "val/t2i_R@5"):
        assert abs(two_val[key] - one_val[key]) <= 1 / 16 + 1e-6, key

    # Resumed on 2 ranks from step 2: weights and optimizer state (Muon's momentum, AdamW's
    # moments and steps, every group's lr) end as the uninterrupted run's, bit for bit.
    _two_ranks([*_args(resumed, demo, tiny_clip_json, 2), f"--ckpt_path={two / 'kept' / 'step=2.ckpt'}"], resumed)
    again = torch.load(resumed / "params" / "rank0.pt", weights_only=True)
    for name, value in params[2].items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=name)
    state = _tensors(torch.load(resumed / "kept" / f"step={STEPS}.ckpt", weights_only=True)["optimizer_states"])
    expected = _tensors(final["optimizer_states"])
    assert state.keys() == expected.keys() and any("momentum_buffer" in k for k in state)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
