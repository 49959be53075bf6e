"""ZeroShot on a user's own data: it scores a labelled ``data.val_data``, and where there is none
its refusal names what to type; the shipped config for unlabelled shards trains."""

from __future__ import annotations

import shutil

import pytest

from mmssl.cli import cli_main
from mmssl.data.sources import expand_urls
from tests.conftest import REPO

DEMO = str(REPO / "configs/demo/clip.yaml")


def _fit(tmp_path, tiny_clip_json, *args: str):
    return cli_main([
        "fit", "--config", DEMO, *args,
        f"--model.init_args.model_name={tiny_clip_json}",
        "--data.init_args.batch_size=16", "--data.init_args.num_workers=0",
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ])


@pytest.fixture
def unlabelled(tmp_path, tiny_demo) -> str:
    """Two image-text shards with no classnames.txt anywhere near them."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for i, url in enumerate(expand_urls(tiny_demo.train)[:2]):
        shutil.copy(url, folder / f"{i:05d}.tar")
    return str(folder / "{00000..00001}.tar")


def test_zero_shot_scores_a_labelled_val_data(tmp_path, tiny_demo, tiny_clip_json):
    # Own training shards (not demo mode): the labelled set is the user's --data.val_data.
    cli = _fit(
        tmp_path, tiny_clip_json, f"--data.train_data={tiny_demo.train}", f"--data.val_data={tiny_demo.eval_dir}"
    )
    metrics = cli.trainer.callback_metrics
    assert 0.0 <= float(metrics["val/zero_shot_top1"]) <= float(metrics["val/zero_shot_top5"]) <= 1.0


@pytest.mark.parametrize("with_val", [True, False])
def test_without_a_labelled_set_the_refusal_names_what_to_type(tmp_path, tiny_clip_json, unlabelled, with_val):
    args = [f"--data.train_data={unlabelled}", *([f"--data.val_data={unlabelled}"] if with_val else [])]
    with pytest.raises((FileNotFoundError, ValueError)) as err:
        _fit(tmp_path, tiny_clip_json, *args)
    message = str(err.value)
    assert message.startswith("ZeroShot")
    assert "--data.val_data LABELLED_SET" in message and "--config configs/demo/no_zero_shot.yaml" in message
    if with_val:
        assert "data.val_data=" in message and "classnames.txt" in message  # what is wrong with the set given
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before training


def test_the_config_without_zero_shot_trains_unlabelled_shards(tmp_path, tiny_clip_json, unlabelled):
    cli = _fit(tmp_path, tiny_clip_json, "--config", str(REPO / "configs/demo/no_zero_shot.yaml"),
               f"--data.train_data={unlabelled}", f"--data.val_data={unlabelled}")
    metrics = cli.trainer.callback_metrics
    assert "val/loss" in metrics and "val/i2t_R@1" in metrics
    assert not any("zero_shot" in k for k in metrics)
    assert cli.trainer.global_step == 2


def test_an_explicit_class_list_is_checked_before_training(tmp_path, tiny_demo, tiny_clip_json):
    # A classnames file given to ZeroShot (not the one beside the data) with a blank line in the
    # middle: refused at start-up, the file and line named, before any step.
    names = tmp_path / "my_classnames.txt"
    names.write_text("red circle\n\nblue square\n")
    with pytest.raises(ValueError, match=r"my_classnames.txt.*line 2"):
        _fit(tmp_path, tiny_clip_json, "--trainer.callbacks+=mmssl.callbacks.ZeroShot",
             f"--trainer.callbacks.classnames={names}", f"--trainer.callbacks.data={tiny_demo.eval_dir}")
    assert not list(tmp_path.rglob("*.ckpt"))
