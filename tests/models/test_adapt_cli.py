"""The adaptation recipes through the real `mmssl fit`: a LoRA run's checkpoint and resume, the
Fashion-MNIST LiT config from an MAE run's checkpoint, and FLYP from the demo CLIP's run to
Fashion-MNIST."""

from __future__ import annotations

import pytest
import torch
import yaml

from mmssl.cli import main
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE
from tests.conftest import REPO
from tests.tools.test_fashion_mnist import fashion_cwd, fm, source  # noqa: F401  (fixtures)

pytest.importorskip("peft")


def test_lora_fit_saves_only_what_trains_and_resumes_on_its_base(tmp_path, tiny_demo, tiny_clip_json):
    # One process, checking what the checkpoint holds and that it resumes: validation is off to keep
    # it short; LoRA with validation on, 1 against 2 ranks, is tests/test_ddp.py's clip_lora case.
    base = tmp_path / "base.pth"
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), base)
    common = [
        "--config", str(REPO / "configs/demo/clip.yaml"), f"--model.init_args.model_name={tiny_clip_json}",
        f"--model.init_args.pretrained={base}", "--model.init_args.lora={r: 2, alpha: 4}",
        f"--data.init_args.demo_dir={tiny_demo.root}", "--data.init_args.batch_size=16",
        "--data.init_args.num_workers=0", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'runs'}",
    ]
    main(["fit", *common, "--trainer.max_steps=2"])
    last = tmp_path / "runs/version_0/checkpoints/last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["lora_base"]["pretrained"]["path"] == str(base)
    assert "model.logit_scale" in saved["state_dict"]
    assert all("lora_" in k for k in saved["state_dict"] if k != "model.logit_scale"), sorted(saved["state_dict"])
    main(["fit", *common, "--trainer.max_steps=3", f"--ckpt_path={last}"])
    resumed = torch.load(tmp_path / "runs/version_1/checkpoints/last.ckpt", weights_only=True)  # a resume's folder
    assert resumed["global_step"] == 3 and set(resumed["state_dict"]) == set(saved["state_dict"])


def test_lit_mae_config_trains_the_text_tower_on_the_mae_run_checkpoint(fashion_cwd):  # noqa: F811
    # An MAE of configs/fashion_mnist/mae_vit_patch4.yaml's sizes, where the LiT config looks for its run.
    mae = MAE(image_size=28, patch_size=4, embed_dim=128, depth=4, num_heads=4, decoder_embed_dim=96,
              decoder_depth=2, decoder_num_heads=4)
    folder = fashion_cwd / "runs/fashion_mnist_mae/version_0/checkpoints"
    folder.mkdir(parents=True)
    torch.save({"state_dict": mae.state_dict(), "hyper_parameters": dict(mae.hparams)}, folder / "last.ckpt")
    main(["fit", "--config", "configs/fashion_mnist/lit_mae.yaml", "--data.init_args.batch_size=4",
          "--data.init_args.num_workers=0", "--trainer.max_steps=1", "--trainer.enable_progress_bar=false",
          "--trainer.limit_val_batches=1", "--trainer.val_check_interval=1", "--trainer.default_root_dir=runs/lit"])
    lit = torch.load(fashion_cwd / "runs/lit/version_0/checkpoints/last.ckpt", weights_only=True)
    trunk = {
        k[len("model.visual.trunk.") :]: v for k, v in lit["state_dict"].items() if k.startswith("model.visual.trunk.")
    }
    assert trunk and all(torch.equal(v, mae.state_dict()["encoder." + k]) for k, v in trunk.items())  # locked
    assert lit["hyper_parameters"]["image_mean"] == [0.485, 0.456, 0.406]
    logged = open(fashion_cwd / "runs/lit/version_0/metrics.csv").readline()
    assert "val/zero_shot_top1" in logged


def test_flyp_demo_to_fashion_mnist_config_starts_from_the_demo_run_and_trains_on_class_prompts(
        fashion_cwd, monkeypatch):  # noqa: F811
    """configs/finetune/clip_flyp_demo_to_fashion_mnist.yaml (docs/adaptation.md) reads the demo CLIP
    where `mmssl fit --config configs/demo/clip.yaml` leaves it and the class names where
    tools/fashion_mnist.py writes them, and its captions are the class prompts, not the shards' own.
    The replay stack onto it reads the demo's training pairs from the demo cache beside
    Fashion-MNIST's, one exact epoch of both, each with its own captions."""
    from mmssl.data.captions import class_captions
    from mmssl.data.demo import ensure_demo_data

    torch.manual_seed(123)  # not the run's seed_everything: a fresh init would not pass for the demo run
    demo = CLIP(str(REPO / "configs/models/clip_tiny.json"))
    folder = fashion_cwd / "runs/demo_clip/version_0/checkpoints"
    folder.mkdir(parents=True)
    torch.save({"state_dict": demo.state_dict(), "hyper_parameters": dict(demo.hparams)}, folder / "last.ckpt")
    main(["fit", "--config", "configs/finetune/clip_flyp_demo_to_fashion_mnist.yaml", "--data.init_args.batch_size=4",
          "--data.init_args.num_workers=0", "--trainer.max_steps=1", "--trainer.enable_progress_bar=false",
          "--trainer.default_root_dir=runs/flyp"])
    run = fashion_cwd / "runs/flyp/version_0"
    end = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert end["global_step"] == 1
    key = "model.visual.conv1.weight"  # started from the demo run's weights, and trained one step from them
    delta = (end["state_dict"][key] - demo.state_dict()[key]).abs().max()
    assert 0 < delta < 1e-2, delta
    # The captions the run made: Fashion-MNIST's classes in its zero-shot prompts (what is scored).
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]["init_args"]
    captions = class_captions(data["captions_from_classes"], data["caption_templates"])
    assert captions.classnames == fm.CLASSNAMES and captions.templates == fm.ZERO_SHOT_TEMPLATES

    # The replay stack: Fashion-MNIST's 7 training pairs and the 5 of a demo cache in $HOME.
    monkeypatch.setenv("HOME", str(fashion_cwd / "home"))
    ensure_demo_data(str(fashion_cwd / "home/.cache/mmssl/demo"), num_train=5, num_val=1, shard_size=5, image_size=32)
    main(["fit", "--config", "configs/finetune/clip_flyp_demo_to_fashion_mnist.yaml", "--config",
          "configs/finetune/clip_flyp_replay_demo_to_fashion_mnist.yaml", "--data.init_args.batch_size=4",
          "--data.init_args.num_workers=0", "--trainer.max_steps=3", "--trainer.enable_progress_bar=false",
          "--trainer.default_root_dir=runs/replay"])
    run = fashion_cwd / "runs/replay/version_0"
    end = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    position = end["ImageTextDataModule"]["position"]
    assert end["global_step"] == 3 and position["samples"] == 7 + 5 and position["skipped"] == 0  # both sets read
    assert end["state_dict"][key].ne(demo.state_dict()[key]).any()  # from the demo run, trained
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]["init_args"]
    assert data["captions_from_classes"] is None  # each sample's own caption
