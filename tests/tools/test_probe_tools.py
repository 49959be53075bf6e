"""tools/linear_probe.py and tools/zero_shot.py on tiny checkpoints of each kind users have."""

import json
from pathlib import Path

import pytest
import timm
import torch

from mmssl.checkpoints import read_checkpoint
from mmssl.cli import main
from tests.cli_runs import run_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lightning_ckpt(tiny_demo, tiny_clip_json, tmp_path_factory) -> Path:
    """A checkpoint written by ``mmssl fit`` (1 step), as users have them."""
    root = tmp_path_factory.mktemp("fit")
    main([
        "fit", "--config", str(REPO / "configs/demo/clip.yaml"),
        f"--model.init_args.model_name={tiny_clip_json}",
        f"--data.init_args.train_data={tiny_demo.train}", f"--data.init_args.val_data={tiny_demo.val}",
        "--data.init_args.train_num_samples=16", "--data.init_args.batch_size=16",
        "--data.init_args.num_workers=0", "--trainer.max_steps=1", "--trainer.limit_val_batches=1",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}",
    ])
    return next(root.glob("version_*/checkpoints/*.ckpt"))


def test_linear_probe_tool_on_lightning_checkpoint(lightning_ckpt, tiny_demo, tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe.json"
    assert run_tool("linear_probe.py", [
        "--ckpt", str(lightning_ckpt), "--train-data", tiny_demo.train, "--val-data", tiny_demo.eval_dir,
        "--all-layers", "--output-json", str(out),
    ], monkeypatch) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "CLIP" and result["feature"] == "cls" and result["method"] == "lbfgs"
    assert (result["num_train"], result["num_val"], result["num_classes"]) == (64, 32, 36)
    assert 0 <= result["top1"] <= result["top5"] <= 1 and 0 <= result["knn_top1"] <= 1
    assert [layer["block"] for layer in result["layers"]] == [1]  # the tiny CLIP has one block
    assert "top1" in capsys.readouterr().out


def test_zero_shot_tool_on_lightning_and_open_clip_files(
    lightning_ckpt, tiny_demo, tiny_clip_json, tmp_path, monkeypatch
):
    assert run_tool("zero_shot.py", ["--ckpt", str(lightning_ckpt), "--data", tiny_demo.eval_dir,
                                     "--output-json", str(tmp_path / "a.json")], monkeypatch) == 0
    from_ckpt = json.loads((tmp_path / "a.json").read_text())
    # The same weights as a plain open_clip state dict give the same figures.
    state = read_checkpoint(str(lightning_ckpt))["state_dict"]
    open_clip_sd = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    torch.save(open_clip_sd, tmp_path / "open_clip.pt")
    assert run_tool("zero_shot.py", ["--ckpt", str(tmp_path / "open_clip.pt"), "--model", tiny_clip_json,
                                     "--data", tiny_demo.eval_dir, "--output-json", str(tmp_path / "b.json")],
                    monkeypatch) == 0
    from_state_dict = json.loads((tmp_path / "b.json").read_text())
    assert from_ckpt["num_samples"] == 32 and from_ckpt["num_templates"] == 5
    for key in ("top1", "top5", "num_samples"):
        assert from_ckpt[key] == pytest.approx(from_state_dict[key])


def test_fit_checkpoint_needs_no_allow_listed_type(lightning_ckpt):
    # What `mmssl fit` writes loads under torch's weights-only set alone, so SAFE_GLOBALS stays empty.
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(lightning_ckpt)) == []
    checkpoint = read_checkpoint(str(lightning_ckpt))
    assert checkpoint["state_dict"] and checkpoint["hyper_parameters"]["model_name"]


def test_linear_probe_tool_on_timm_state_dict(tiny_demo, tmp_path, monkeypatch):
    kwargs = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **kwargs)
    torch.save(vit.state_dict(), tmp_path / "vit.pth")
    out = tmp_path / "probe.json"
    assert run_tool("linear_probe.py", [  # --layers all: the old spelling of --all-layers, still accepted
        "--ckpt", str(tmp_path / "vit.pth"), "--model", "vit_tiny_patch16_224", "--model-kwargs", json.dumps(kwargs),
        "--train-data", tiny_demo.train, "--val-data", tiny_demo.eval_dir, "--feature", "avg",
        "--layers", "all", "--method", "mae", "--epochs", "2", "--output-json", str(out),
    ], monkeypatch) == 0
    result = json.loads(out.read_text())
    assert result["feature"] == "avg" and result["method"] == "mae" and result["feature_dim"] == 32
    assert len(result["layers"]) == 2 and result["num_train"] == 64


def test_tool_names_a_missing_checkpoint(tmp_path, monkeypatch, capsys):
    assert run_tool("zero_shot.py", ["--ckpt", str(tmp_path / "none.ckpt"), "--data", str(tmp_path)], monkeypatch) == 1
    err = capsys.readouterr().err
    assert err.startswith("zero_shot: ") and "--ckpt" in err and str(tmp_path / "none.ckpt") in err
    assert err.count("\n") == 1  # one line, no traceback


def test_zero_shot_tool_reads_a_clip_benchmark_folder_by_root_or_split(
    lightning_ckpt, tiny_demo, tmp_path, monkeypatch
):
    """The demo's held-out shards as clip_benchmark_export_wds lays out a set (test split, side
    files at the root only): the same figures as the demo folder, whether given DIR or DIR/test."""
    import shutil

    root = tmp_path / "wds_demo"
    (root / "test").mkdir(parents=True)
    shards = sorted(Path(tiny_demo.eval_dir).glob("*.tar"))
    for shard in shards:
        shutil.copy(shard, root / "test" / shard.name)
    (root / "test" / "nshards.txt").write_text(f"{len(shards)}\n")
    for name in ("classnames.txt", "zeroshot_classification_templates.txt"):
        shutil.copy(Path(tiny_demo.root) / name, root / name)
    results = []
    for i, data in enumerate((tiny_demo.eval_dir, str(root), str(root / "test"))):
        assert run_tool("zero_shot.py", ["--ckpt", str(lightning_ckpt), "--data", data,
                                         "--output-json", str(tmp_path / f"{i}.json")], monkeypatch) == 0
        results.append(json.loads((tmp_path / f"{i}.json").read_text()))
    keys = ("top1", "top5", "num_samples", "num_classes", "num_templates")
    assert [[r[k] for k in keys] for r in results[1:]] == [[results[0][k] for k in keys]] * 2
    assert results[0]["num_samples"] == 32 and results[0]["num_classes"] == 36
