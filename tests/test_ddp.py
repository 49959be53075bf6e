"""DDP through the real CLI, validation on: 2 gloo CPU processes stacked with configs/trainer/ddp_cpu.yaml.

Validation shards are dealt over ranks, so with one validation shard rank 1 has no batch at all,
and with three shards on 2 ranks x 2 workers the ranks hold 2 and 1. Both once hung the run (a
collective joined only by the ranks with data). Every run here has a hard timeout and a short
process-group timeout, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl, run_one_process
from tests.tiny import TINY_MAE_FLAGS

DDP = ["--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT]


def _common(recipe: str, tmp_path, demo, clip_json: str, val_data: str) -> list[str]:
    clip = recipe in ("clip", "coca", "clip_lora")
    model = [f"--model.init_args.model_name={clip_json}"] if clip else [*TINY_MAE_FLAGS]
    if recipe == "clip_lora":  # LoRA adapters (r 2) on both towers of a saved base CLIP
        model += [f"--model.init_args.pretrained={_lora_base(clip_json, tmp_path)}", "--model.init_args.lora={r: 2}"]
    return [
        "fit", "--config", str(REPO / f"configs/demo/{recipe.removesuffix('_lora')}.yaml"), *model,
        f"--data.init_args.demo_dir={demo.root}", f"--data.init_args.val_data={val_data}",
        "--data.init_args.batch_size=4", f"--trainer.default_root_dir={tmp_path / 'runs'}",
        "--trainer.enable_progress_bar=false",
    ]


def _lora_base(clip_json: str, folder) -> str:
    """A base CLIP's open_clip state dict for ``model.pretrained`` (seeded: both runs get one base)."""
    from mmssl.models.clip import CLIP

    torch.manual_seed(0)
    path = folder / "lora_base.pth"
    torch.save(CLIP(model_name=clip_json).model.state_dict(), path)
    return str(path)


def _val_shards(demo, how: str) -> str:
    """``one``: a single held-out shard (rank 1 gets none); ``uneven``: three 16-sample shards."""
    val, train = os.path.dirname(demo.val), os.path.dirname(demo.train)
    if how == "one":
        return f"{val}/0.tar"
    return "::".join(f"{train}/{i}.tar" for i in range(3))


@pytest.mark.parametrize("recipe, val", [("mae", "uneven")])
def test_readme_ddp_command_finishes_with_validation_on(recipe, val, tmp_path, tiny_demo, tiny_clip_json):
    """The README's 2-process command, validation at every epoch end, ranks in lockstep after 2
    epochs of training. Its CLIP config (configs/demo/clip.yaml + ddp_cpu.yaml) runs below in
    test_two_processes_log_the_figures_of_one[clip-uneven] (and, rank 1 without a val batch, in
    [clip_lora-one]); CLIP's ranks training in lockstep: tests/models/test_gradcache_distill_cli.py."""
    out = run_mmssl([
        *_common(recipe, tmp_path, tiny_demo, tiny_clip_json, _val_shards(tiny_demo, val)), *DDP,
        "--data.init_args.num_workers=2", "--trainer.max_epochs=2",
        "--trainer.callbacks+=helpers.DumpParams", f"--trainer.callbacks.folder={tmp_path / 'params'}",
    ], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "world_size=2" in out.stdout and "global_batch_size=8" in out.stdout
    rank0 = torch.load(tmp_path / "params" / "rank0.pt")
    rank1 = torch.load(tmp_path / "params" / "rank1.pt")
    for name in rank0:
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0, msg=name)
    metrics = last_metrics(tmp_path / "runs" / "version_0")
    assert "val/loss" in metrics and metrics["val/loss"] == metrics["val/loss"]  # logged, not NaN


CALLBACKS = {
    "clip": ["--trainer.callbacks+=mmssl.callbacks.LinearProbe", "--trainer.callbacks.layers=true",
             "--trainer.callbacks.max_train_samples=40",  # the set's first 40: the same on 1 or 2 ranks
             "--trainer.callbacks+=mmssl.callbacks.KNNProbe", "--trainer.callbacks.max_train_samples=40",
             "--trainer.callbacks+=mmssl.callbacks.DenseProbe", "--trainer.callbacks.train_images=24",
             "--trainer.callbacks.test_images=7"],  # odd: rank 1 pads its share
    "mae": ["--trainer.callbacks+=mmssl.callbacks.LinearProbe", "--trainer.callbacks.layers=true",
            "--trainer.callbacks+=mmssl.callbacks.KNNProbe",
            "--trainer.callbacks+=mmssl.callbacks.DenseProbe", "--trainer.callbacks.train_images=24",
            "--trainer.callbacks.test_images=7",  # odd: rank 1 pads its share
            "--trainer.callbacks+=mmssl.callbacks.Reconstructions", "--trainer.callbacks.every_n_steps=1",
            "--trainer.callbacks.num_images=2"],
    "coca": ["--trainer.callbacks+=mmssl.callbacks.CaptionNaming", "--trainer.callbacks.max_samples=12",
             "--trainer.callbacks.seq_len=6"],
}


@pytest.mark.parametrize("recipe, val", [("clip", "uneven"), ("mae", "one"), ("coca", "uneven"), ("clip_lora", "one")])
def test_two_processes_log_the_figures_of_one(recipe, val, tmp_path, tiny_demo, tiny_clip_json, tiny_coca_json):
    """val/loss, retrieval, zero-shot, linear (per block), k-NN and dense probes, and the demo configs'
    label-free health figures (EmbeddingHealth): 2 ranks = 1 process; CoCa's captioning figures
    (token-weighted, so the ranks' different caption lengths cancel) too. With LoRA, every rank
    trains the adapters (and logit_scale) only, their gradients all-reduced to one.

    The learning rate is 0, so both runs validate the same weights; validation shards hold
    whole batches (16 samples, batch 4), so CLIP's in-batch loss sees the same batches too.
    """
    if recipe == "clip_lora":
        pytest.importorskip("peft")
    figures = []
    for processes in (1, 2):
        folder = tmp_path / f"p{processes}"
        folder.mkdir()
        lr = ("--model.init_args.blr=0.0" if recipe == "mae" else "--model.init_args.optimizer.init_args.lr=0.0")
        model_json = tiny_coca_json if recipe == "coca" else tiny_clip_json
        args = [
            *_common(recipe, folder, tiny_demo, model_json, _val_shards(tiny_demo, val)),
            *(DDP if processes == 2 else []), lr, "--data.init_args.num_workers=2",
            "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", *CALLBACKS[recipe.removesuffix("_lora")],
        ]
        if recipe == "coca":  # its demo validates by steps; here at the epoch's end, as the others
            args += [
                "--trainer.max_steps=-1",
                "--trainer.val_check_interval=1.0",
                "--trainer.check_val_every_n_epoch=1",
            ]
        if recipe == "clip_lora" and processes == 2:
            # Rank 1 imports peft (and with it transformers, ~7 s of CPU) before it joins the
            # rendezvous, which waits no longer than the process-group timeout: more of it here.
            args += ["--trainer.callbacks+=helpers.DumpGrads", f"--trainer.callbacks.folder={tmp_path / 'grads'}",
                     "--trainer.strategy.init_args.timeout=0:02:30"]
        out = run_mmssl(args, folder) if processes == 2 else run_one_process(args)
        assert out.returncode == 0, out.stdout[-3000:]
        # The callbacks' figures are reduced over ranks and logged as such: no Lightning advice.
        assert "sync_dist=True" not in out.stdout, out.stdout[-3000:]
        figures.append(last_metrics(folder / "runs" / "version_0", ("val/", "probe/", "health/")))
    one, two = figures
    expected = {"val/loss", "health/rankme", "health/alignment", "health/uniformity"}
    expected |= {"probe/linear_top1", "probe/linear_top1_block1", "probe/knn_top1", "probe/dense_miou",
                 "probe/dense_patch_accuracy"} if recipe != "coca" else set()
    expected |= {"val/zero_shot_top1", "val/i2t_R@1", "val/t2i_R@10", "health/modality_gap",
                 "health/logit_scale"} if recipe != "mae" else set()
    expected |= {"val/caption_loss", "val/caption_token_top1", "val/contrastive_loss",
                 "val/caption_names_class"} if recipe == "coca" else set()
    assert expected <= one.keys() and one.keys() == two.keys()
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), key
    if recipe == "mae":
        assert list((tmp_path / "p2" / "runs" / "version_0" / "reconstructions").glob("*.png"))
    if recipe == "clip_lora":
        _assert_ranks_train_the_same_adapters(tmp_path / "grads")


def _assert_ranks_train_the_same_adapters(folder) -> None:
    """Both ranks: the trainable parameters are the adapters and logit_scale, exactly those get
    gradients, and the gradients are one (all-reduced); lora_B's are not zero (lora_A's are while
    B starts at 0)."""
    rank0, rank1 = (torch.load(folder / f"rank{r}.pt") for r in (0, 1))
    for rank in (rank0, rank1):
        assert rank["trainable"] and all("lora_" in n or n == "model.logit_scale" for n in rank["trainable"])
        assert any(".transformer.resblocks." in n and "visual" not in n for n in rank["trainable"])  # text tower too
        assert sorted(rank["grads"]) == rank["trainable"]
    assert rank0["trainable"] == rank1["trainable"]
    for name, grad in rank0["grads"].items():
        torch.testing.assert_close(rank1["grads"][name], grad, rtol=0, atol=0, msg=name)
    assert any(g.abs().sum() > 0 for n, g in rank0["grads"].items() if "lora_B" in n)
