"""The CLI end to end: each run goes through ``main([...])`` exactly as ``mmssl`` would."""

import csv
from pathlib import Path

import pytest
import yaml

from mmssl.cli import cli_main, main

REPO = Path(__file__).resolve().parents[1]


def _metrics(run: Path) -> dict[str, float]:
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    out: dict[str, float] = {}
    for row in rows:
        out.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return out


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for sub in ("fit", "validate", "test", "predict"):
        assert sub in out


def test_a_bad_sigterm_grace_leaves_help_working_and_stops_fit_naming_it(monkeypatch, capsys, tmp_path):
    from mmssl.signals import GRACE_ENV, sigterm_grace_s

    monkeypatch.setenv(GRACE_ENV, "abc")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0 and "--ckpt_path" in capsys.readouterr().out
    with pytest.raises(ValueError, match=f"{GRACE_ENV}='abc': expected a number of seconds >= 0"):
        main(["fit", "--config", str(REPO / "configs/demo/mae.yaml"), f"--trainer.default_root_dir={tmp_path}"])
    assert not list(tmp_path.iterdir())  # refused before anything was built
    for bad in ("-1", "inf", "nan"):  # a negative or endless grace would lose the hard exit
        with pytest.raises(ValueError, match=f"{GRACE_ENV}='{bad}'"):
            sigterm_grace_s({GRACE_ENV: bad})
    assert [sigterm_grace_s(env) for env in ({}, {GRACE_ENV: ""}, {GRACE_ENV: "0"}, {GRACE_ENV: "2.5"})] == [
        60,
        60,
        0,
        2.5,
    ]


def test_clip_demo_config_fits_end_to_end(tmp_path, tiny_demo, tiny_clip_json, capsys):
    main([
        "fit", "--config", str(REPO / "configs/demo/clip.yaml"),
        f"--model.init_args.model_name={tiny_clip_json}",
        f"--data.init_args.demo_dir={tiny_demo.root}",
        "--data.init_args.batch_size=16", "--data.init_args.num_workers=0",
        "--trainer.max_epochs=1", "--trainer.log_every_n_steps=1",  # 4 steps: 64 samples / 16
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ])
    runs = list(tmp_path.glob("version_*"))
    assert len(runs) == 1, runs  # TensorBoard and CSV share one run folder
    run = runs[0]
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert (run / "config.yaml").exists() and list(run.glob("events.out.tfevents.*"))
    metrics = _metrics(run)
    assert {"train/loss", "val/loss", "val/zero_shot_top1", "val/zero_shot_top5"} <= set(metrics)
    assert 0.0 <= metrics["val/zero_shot_top1"] <= metrics["val/zero_shot_top5"] <= 1.0
    out = capsys.readouterr().out
    assert "run folder:" in out and "last.ckpt" in out and "val/zero_shot_top1" in out

    # `mmssl validate` on the saved checkpoint reproduces the end-of-fit zero-shot figure.
    cli = cli_main([
        "validate", "--config", str(REPO / "configs/demo/clip.yaml"),
        f"--model.init_args.model_name={tiny_clip_json}",
        f"--data.init_args.demo_dir={tiny_demo.root}",
        "--data.init_args.batch_size=16", "--data.init_args.num_workers=0",
        f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--trainer.default_root_dir={tmp_path / 'val'}",
        "--trainer.enable_progress_bar=false",
    ])
    validated = cli.trainer.callback_metrics["val/zero_shot_top1"].item()
    last_fit = [float(r["val/zero_shot_top1"]) for r in csv.DictReader(open(run / "metrics.csv"))
                if r.get("val/zero_shot_top1")][-1]
    assert abs(validated - last_fit) < 1e-6


def test_print_config_runs_again_as_is(tmp_path, tiny_demo, tiny_clip_json, capsys):
    common = [
        f"--model.init_args.model_name={tiny_clip_json}",
        f"--data.init_args.demo_dir={tiny_demo.root}",
        "--data.init_args.batch_size=8", "--data.init_args.num_workers=0",
    ]
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs/demo/clip.yaml"), *common, "--print_config"])
    printed = capsys.readouterr().out
    config = yaml.safe_load(printed)
    assert config["model"]["class_path"] == "mmssl.models.clip.CLIP"
    assert config["data"]["init_args"]["batch_size"] == 8
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    main([
        "fit", "--config", str(saved), "--trainer.max_steps=1", "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar=false",
    ])


def test_bad_model_name_fails_before_training_with_the_key(tmp_path):
    with pytest.raises(Exception, match="model.model_name"):
        main(["fit", "--config", str(REPO / "configs/demo/clip.yaml"),
              "--model.init_args.model_name=NoSuchModel-X", f"--trainer.default_root_dir={tmp_path}"])


@pytest.mark.parametrize("name", ["ddp", "ddp_cpu", "fsdp"])
def test_trainer_configs_stack_onto_a_recipe(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs/demo/clip.yaml"),
              "--config", str(REPO / f"configs/trainer/{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    expected = "FSDPStrategy" if name == "fsdp" else "DDPStrategy"
    assert trainer["strategy"]["class_path"].endswith(expected)
    assert trainer["default_root_dir"] == "runs/demo_clip"  # the recipe's values survive


@pytest.mark.parametrize("data_args, message", [
    (["--data.init_args.train_data=/nonexistent/shards/"], "data.train_data='/nonexistent/shards/'"),
    (["--data.init_args.batch_size=65"], "64 samples cannot fill one global batch"),  # 1 rank x 65 > 64 samples
])
def test_data_config_errors_fail_before_training(data_args, message, tmp_path, tiny_demo, tiny_clip_json):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        main(["fit", "--config", str(REPO / "configs/demo/clip.yaml"),
              f"--model.init_args.model_name={tiny_clip_json}",
              f"--data.init_args.demo_dir={tiny_demo.root}", *data_args,
              f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"])
    assert not list(tmp_path.rglob("*.ckpt"))  # no step was taken


def test_recipe_model_config_is_found_from_another_folder(tmp_path, monkeypatch):
    from mmssl.models.clip import resolve_model_name

    monkeypatch.chdir(tmp_path)  # recipes name configs/models/... relative to the repository
    assert resolve_model_name("configs/models/clip_tiny.json") == "clip_tiny"
    with pytest.raises(FileNotFoundError, match="no model config file"):
        resolve_model_name("configs/models/nope.json")
