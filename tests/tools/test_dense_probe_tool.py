"""tools/dense_probe.py end to end on tiny checkpoints (CLIP and MAE, as Lightning writes them):
the figures printed and written as JSON, the subcommand's name, and a model without patch tokens
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from mmssl.data.demo import DENSE_CLASSES
from tests.cli_runs import run_tool
from tests.tiny import TINY_MAE
from tests.tools.ema_helpers import save_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_clip_json) -> dict[str, str]:
    """A tiny CLIP and a tiny MAE (32-pixel images, 8-pixel patches: a 4 x 4 grid), untrained."""
    import torch

    from mmssl.models.clip import CLIP
    from mmssl.models.mae import MAE

    root = tmp_path_factory.mktemp("dense_ckpts")
    torch.manual_seed(0)
    clip = save_checkpoint(root / "clip.ckpt", CLIP(model_name=tiny_clip_json), None, "mmssl.models.clip.CLIP")
    return {"CLIP": clip, "MAE": save_checkpoint(root / "mae.ckpt", MAE(**TINY_MAE), None, "mmssl.models.mae.MAE")}


@pytest.mark.parametrize("kind", ["CLIP", "MAE"])
def test_dense_probe_tool_runs_end_to_end_and_writes_its_json(kind, checkpoints, tmp_path, monkeypatch, capsys):
    out = tmp_path / "dense.json"
    assert run_tool("dense_probe.py", ["--ckpt", checkpoints[kind], "--train-images", "12", "--test-images", "6",
                                       "--max-iter", "50", "--output-json", str(out)], monkeypatch) == 0
    report = json.loads(out.read_text())
    assert report["model"] == kind and report["checkpoint"] == checkpoints[kind]
    assert (report["image_size"], report["patch_size"], report["grid"]) == (32, 8, 4)
    assert (report["num_train_images"], report["num_test_images"], report["seed"]) == (12, 6, 0)
    assert report["num_patches"] == 6 * 16 and report["num_train_patches"] == 12 * 16
    assert 0 <= report["miou"] <= 1 and 0 <= report["patch_accuracy"] <= 1
    assert 0 < report["majority_miou"] <= 1 and list(report["per_class_iou"]) == list(DENSE_CLASSES)
    assert report["per_class_iou"]["background"] is not None  # background is in every scene
    assert len(report["confusion"]) == len(DENSE_CLASSES)
    printed = capsys.readouterr().out
    assert "miou" in printed and "iou background" in printed and f"wrote {out}" in printed


def test_the_same_seed_gives_the_same_figures_and_held_out_scenes_are_other_scenes(checkpoints, tmp_path,
                                                                                   monkeypatch):
    from mmssl.data import demo

    drawn = []
    real = demo.dense_demo_set
    monkeypatch.setattr(demo, "dense_demo_set", lambda *args: drawn.append(args) or real(*args))
    reports = []
    for name, seed in (("a", "3"), ("b", "3")):
        argv = ["--ckpt", checkpoints["CLIP"], "--train-images", "8", "--test-images", "4", "--seed", seed,
                "--max-iter", "30", "--output-json", str(tmp_path / f"{name}.json")]
        assert run_tool("dense_probe.py", argv, monkeypatch) == 0
        reports.append(json.loads((tmp_path / f"{name}.json").read_text()))
    for report in reports:
        report.pop("seconds")
    assert reports[0] == reports[1]
    assert drawn == [(8, 32, 3), (4, 32, 4)] * 2  # training scenes from --seed, held-out ones from --seed + 1


def test_it_is_the_dense_probe_subcommand():
    from mmssl.commands import tools

    assert tools()["dense-probe"] == "dense_probe"


def test_a_model_without_patch_tokens_is_refused_in_one_line(checkpoints, tmp_path, monkeypatch, capsys):
    class EmbeddingOnly(nn.Module):
        image_size, image_mean, image_std = 32, (0.5,) * 3, (0.5,) * 3

        def encode_image(self, images):
            return images.mean(dim=(2, 3))

    monkeypatch.setattr("mmssl.evaluation.encoders.load_encoder", lambda *args: EmbeddingOnly())
    out = tmp_path / "dense.json"
    assert run_tool("dense_probe.py", ["--ckpt", checkpoints["CLIP"], "--output-json", str(out)], monkeypatch) == 1
    err = capsys.readouterr().err
    assert err.startswith("dense_probe: EmbeddingOnly gives no patch tokens") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--train-images", "0"], ["--test-images", "-1"], ["--max-iter", "0"]])
def test_sizes_below_one_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_tool_main(["--ckpt", "x.ckpt", *argv])
    assert exit_.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def run_tool_main(argv: list[str]) -> int:
    import runpy

    return runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "dense_probe.py"),
                          run_name="not_main")["main"](argv)


@pytest.mark.parametrize("kind", ["CLIP", "MAE"])
def test_the_callback_logs_the_tools_figures_for_the_same_checkpoint(kind, checkpoints, tmp_path, monkeypatch):
    """docs/evaluation.md: DenseProbe with the tool's counts, seed and fit settings gives its figures."""
    import contextlib
    import types

    import torch

    from mmssl.callbacks import DenseProbe
    from mmssl.evaluation.encoders import load_encoder

    out = tmp_path / "dense.json"
    argv = ["--ckpt", checkpoints[kind], "--train-images", "16", "--test-images", "8", "--seed", "3",
            "--max-iter", "60", "--weight-decay", "0.01", "--output-json", str(out)]
    assert run_tool("dense_probe.py", argv, monkeypatch) == 0
    report = json.loads(out.read_text())
    model = load_encoder(checkpoints[kind], None, None, None, False)
    trainer = types.SimpleNamespace(world_size=1, global_rank=0,
                                    precision_plugin=types.SimpleNamespace(forward_context=contextlib.nullcontext))
    if not hasattr(model, "device"):  # a LightningModule has it; load_encoder may give a plain module
        model.device = torch.device("cpu")
    scores = DenseProbe(train_images=16, test_images=8, seed=3, max_iter=60, weight_decay=0.01).evaluate(trainer, model)
    assert scores["miou"] == pytest.approx(report["miou"], abs=1e-9)
    assert scores["patch_accuracy"] == pytest.approx(report["patch_accuracy"], abs=1e-9)
    assert scores["per_class_iou"] == pytest.approx(report["per_class_iou"])
