"""Config keys that moved into groups (mmssl.renames): files written before the move keep working.

The fixtures in ``tests/fixtures/saved_before_parts`` were written by ``main`` at 36c5be3, before
FLIP, tower locking and distillation became CLIP's ``flip`` / ``lock`` / ``distill`` groups: a
run's ``config.yaml`` and the ``hyper_parameters`` of a CLIP and a CoCa checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from mmssl.callbacks.guards import NonFiniteGuard
from mmssl.checkpoints.load import load_lightning
from mmssl.cli import cli_main
from mmssl.models.clip import CLIP
from mmssl.models.coca import CoCa
from mmssl.models.distill import Distillation
from mmssl.models.flip import Flip
from mmssl.models.locking import LockOptions
from mmssl.renames import move_keys, upgrade_command_line, upgrade_config, upgrade_init_args
from tests.tiny import TINY_MAE

REPO = Path(__file__).resolve().parents[1]
SAVED = REPO / "tests" / "fixtures" / "saved_before_parts"


def test_a_config_yaml_saved_before_the_groups_trains_the_same_model(tmp_path, monkeypatch, tiny_demo):
    monkeypatch.chdir(REPO)  # the saved config names configs/models/clip_tiny.json from the repository root
    with pytest.warns(FutureWarning, match="clip_config.yaml.*image_mask_ratio -> flip.mask_ratio"):
        cli = cli_main(["fit", "--config", str(SAVED / "clip_config.yaml"), "--trainer.default_root_dir", str(tmp_path),
                        "--trainer.max_steps=4", "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0",
                        f"--data.init_args.demo_dir={tiny_demo.root}",
                        "--data.init_args.batch_size=4", "--data.init_args.num_workers=0"])
    model = cli.model
    assert model.flip_options == Flip(mask_ratio=0.25, unmasked_tune_steps=3)
    assert model.image_mask_ratio == 0.25 and model.flip_options.tuning_phase().steps == 3
    assert model.hparams["lock"] == {**vars(LockOptions(text=True, text_unlocked_layers=1))}
    # lock.text with one group left (open_clip's last group is the projection): it trains, the blocks do not.
    assert model.model.text_projection.requires_grad
    assert not any(p.requires_grad for p in model.model.transformer.resblocks.parameters())
    assert all(p.requires_grad for p in model.model.visual.parameters())
    assert model.hparams["distill"]["feature_loss"] == "mse" and model.distiller is None
    assert cli.trainer.global_step == 4 and model.flip.ratio == 0.0  # the last 3 steps tuned unmasked
    saved = yaml.safe_load(next(tmp_path.glob("version_*/config.yaml")).read_text())  # written with the new keys
    assert saved["model"]["init_args"]["flip"]["mask_ratio"] == 0.25 and "image_mask_ratio" not in saved["model"]


@pytest.mark.parametrize("kind", ["clip", "coca"])
def test_a_checkpoint_saved_before_the_groups_loads_into_its_class(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    hparams = yaml.safe_load((SAVED / "hyper_parameters.yaml").read_text())[kind]
    cls = {"clip": CLIP, "coca": CoCa}[kind]
    with pytest.warns(FutureWarning):
        trained = cls(**upgrade_init_args(cls, {k: v for k, v in hparams.items() if k != "_class_path"}, "test"))
    torch.save({"state_dict": trained.state_dict(), "hyper_parameters": hparams}, tmp_path / "old.ckpt")
    with pytest.warns(FutureWarning, match="old.ckpt"):
        loaded = load_lightning(str(tmp_path / "old.ckpt"))
    assert type(loaded) is cls
    assert loaded.flip_options.mask_ratio == hparams["image_mask_ratio"]
    assert loaded.flip_options.unmasked_tune_steps == hparams["unmasked_tune_steps"]
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)


def test_a_checkpoint_records_the_groups_as_plain_data():
    model = CLIP(str(REPO / "configs/models/clip_micro.json"), flip=Flip(mask_ratio=0.5), lock={"text": True},
                 warmup_steps=1)
    assert model.hparams["flip"] == {**vars(Flip(mask_ratio=0.5))}
    assert model.hparams["lock"]["text"] is True and isinstance(model.hparams["distill"], dict)
    assert model.hparams_initial["flip"]["mask_ratio"] == 0.5  # what the loggers' hparams.yaml gets


def test_an_unknown_option_of_a_group_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"model.init_args.flip: unknown options \['ratio'\]"):
        CLIP(str(REPO / "configs/models/clip_micro.json"), flip={"ratio": 0.5})


def test_an_old_key_and_its_new_place_that_disagree_are_refused_naming_both():
    with pytest.raises(ValueError, match="'image_mask_ratio'.*'flip.mask_ratio'"):
        move_keys({"image_mask_ratio": 0.5, "flip": {"mask_ratio": 0.25}}, CLIP.renamed_args, "run/config.yaml")
    same, moves = move_keys({"image_mask_ratio": 0.5, "flip": {"mask_ratio": 0.5}}, CLIP.renamed_args, "x")
    assert same == {"flip": {"mask_ratio": 0.5}} and moves == ["image_mask_ratio -> flip.mask_ratio"]


def test_old_flags_on_the_command_line_are_moved():
    args = upgrade_command_line(
        ["fit", "--model.init_args.lock_text=true", "--model.teacher", "t.ckpt", "--model.init_args.warmup_steps=2"],
        CLIP.renamed_args, lambda path: None, yaml.safe_dump)
    assert args == ["fit", "--model.init_args.lock.text=true", "--model.init_args.distill.teacher", "t.ckpt",
                    "--model.init_args.warmup_steps=2"]


def test_a_model_section_without_its_class_takes_the_models_renames_and_other_classes_keep_their_keys():
    config = {"model": {"init_args": {"teacher_embeddings": "emb", "warmup_steps": 3}},
              "trainer": {"callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                         "init_args": {"lock_image": 1}}]}}
    out, moves = upgrade_config(config, "override.yaml", CLIP.renamed_args)
    assert out["model"]["init_args"] == {"distill": {"embeddings": "emb"}, "warmup_steps": 3}
    assert out["trainer"] == config["trainer"] and moves == ["teacher_embeddings -> distill.embeddings"]
    flat, _ = upgrade_config({"model": {"lock_image": True}}, "x", CLIP.renamed_args)
    assert flat == {"model": {"lock": {"image": True}}}


def test_coca_passes_clips_options_to_clips_own_checks_naming_the_key():
    """CoCa is CLIP with captioning: CLIP's groups reach CLIP's checks (no list of CoCa refusals)."""
    coca = str(REPO / "configs/models/coca_tiny.json")
    with pytest.raises(FileNotFoundError, match=r"^model.init_args.distill.teacher: no teacher file or folder at"):
        CoCa(coca, distill=Distillation(teacher="t.ckpt"))
    with pytest.raises(ValueError, match=r"^model.lora needs model.pretrained"):
        CoCa(coca, lora={"r": 4})
    with pytest.raises(ValueError, match=r"^model.trim_text_padding: the text tower of .* is not causal"):
        CoCa(coca, trim_text_padding=True)
    assert CoCa(coca, loss="siglip").model.logit_bias is not None


def test_a_config_with_the_guards_old_cadence_key_reads_at_that_interval_and_warns_naming_the_new_key(
        tmp_path, tiny_demo):
    # check_every_n_steps, now every_n_steps as on EmbeddingHealth and Reconstructions. Fused AdamW
    # takes the sync-free path, whose host reads follow the interval: steps 3 and 6, and the end.
    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "trainer": {"max_steps": 6, "log_every_n_steps": 50, "limit_val_batches": 0, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"class_path": "mmssl.models.mae.MAE", "init_args": {
            **TINY_MAE, "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"fused": True}}}},
        "data": {"class_path": "mmssl.data.datamodule.ImageTextDataModule",
                 "init_args": {"batch_size": 8, "num_workers": 0, "demo_dir": tiny_demo.root}},
        "nonfinite_guard": {"max_consecutive": 4, "check_every_n_steps": 3},
    }))
    with pytest.warns(FutureWarning, match=r"old.yaml: renamed config keys .*check_every_n_steps -> every_n_steps"):
        cli = cli_main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)])
    guard = next(c for c in cli.trainer.callbacks if isinstance(c, NonFiniteGuard))
    assert (guard.max_consecutive, guard.every_n_steps) == (4, 3)
    assert cli.trainer.global_step == 6 and guard.host_reads == 3  # the default (logging steps) reads once


def test_the_guards_old_flag_is_moved_and_other_sections_keep_theirs():
    sections = {"nonfinite_guard": NonFiniteGuard.renamed_args}
    with pytest.warns(FutureWarning, match=r"the command line.*--nonfinite_guard.check_every_n_steps -> "
                                           r"--nonfinite_guard.every_n_steps"):
        args = upgrade_command_line(["fit", "--nonfinite_guard.check_every_n_steps=3", "--summary.check_every_n_steps",
                                     "2", "--nonfinite_guard.max_consecutive=2"], {}, lambda path: None,
                                    yaml.safe_dump, sections)
    assert args == ["fit", "--nonfinite_guard.every_n_steps=3", "--summary.check_every_n_steps", "2",
                    "--nonfinite_guard.max_consecutive=2"]
    out, moves = upgrade_config({"nonfinite_guard": {"check_every_n_steps": 3}, "summary": {"check_every_n_steps": 1}},
                                "x.yaml", {}, sections)
    assert out == {"nonfinite_guard": {"every_n_steps": 3}, "summary": {"check_every_n_steps": 1}}
    assert moves == ["check_every_n_steps -> every_n_steps"]


def test_the_command_line_moves_only_the_keys_its_models_class_renamed(tmp_path):
    # M3AE's image_mask_ratio is its own: CLIP's rename of that key (to flip.mask_ratio) is no M3AE key.
    m3ae = str(REPO / "configs/demo/m3ae.yaml")
    read = lambda path: yaml.safe_load(open(path)) if Path(path).is_file() else None  # noqa: E731
    for args in (["fit", "--config", m3ae, "--model.init_args.image_mask_ratio", "0.5"],
                 ["fit", f"--config={m3ae}", "--model.init_args.image_mask_ratio=0.5"],
                 ["fit", "--model", "M3AE", "--model.image_mask_ratio=0.5"],
                 ["fit", "--model.class_path", "mmssl.models.m3ae.M3AE", "--model.init_args.image_mask_ratio=0.5"]):
        assert upgrade_command_line(args, CLIP.renamed_args, read, yaml.safe_dump) == args
    # A config file's model section without a class_path takes the class of the command line.
    override = tmp_path / "override.yaml"
    override.write_text("model:\n  init_args:\n    image_mask_ratio: 0.5\n")
    args = ["fit", "--config", m3ae, "--config", str(override)]
    assert upgrade_command_line(args, CLIP.renamed_args, read, yaml.safe_dump) == args
    # CLIP's (the recipe's class, or the last one named) still move.
    clip = str(REPO / "configs/demo/clip.yaml")
    with pytest.warns(FutureWarning, match="image_mask_ratio"):
        assert upgrade_command_line(["fit", "--config", clip, "--model.init_args.image_mask_ratio", "0.5"],
                                    CLIP.renamed_args, read, yaml.safe_dump)[3] == "--model.init_args.flip.mask_ratio"
    with pytest.warns(FutureWarning, match="image_mask_ratio"):
        assert upgrade_command_line(["fit", "--config", m3ae, "--model", "mmssl.models.clip.CLIP",
                                     "--model.image_mask_ratio=0.5"], CLIP.renamed_args, read, yaml.safe_dump)[-1] \
            == "--model.init_args.flip.mask_ratio=0.5"


def test_m3aes_own_image_mask_ratio_on_the_command_line_reaches_it(capsys):
    from mmssl.cli import main

    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "demo/m3ae", "--model.init_args.image_mask_ratio", "0.5", "--print_config"])
    out = capsys.readouterr()
    assert info.value.code == 0, out.err[-2000:]
    assert yaml.safe_load(out.out)["model"]["init_args"]["image_mask_ratio"] == 0.5
