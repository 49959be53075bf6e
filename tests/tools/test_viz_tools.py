"""tools/attention_maps.py, tools/similarity_map.py and tools/scaling_fit.py on tiny checkpoints and
run folders made here; the EmbeddingProjector callback through the real CLI on 1 and 2 processes."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from mmssl.data.demo import SHAPES
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE
from mmssl.visualize.scaling import power_law, read_run
from tests.cli_runs import PG_TIMEOUT, REPO, run_mmssl, run_one_process, run_tool
from tests.tiny import tiny_mae

TINY_MAE = tiny_mae(depth=2)


def pngs(folder: Path) -> list[str]:
    """The PNGs a tool wrote below ``folder``, sorted."""
    return sorted(str(p) for p in folder.rglob("*.png"))


def _lightning_file(module, class_path: str, path: Path) -> Path:
    """What ``mmssl fit`` saves, reduced to what the tools read: weights and hyper-parameters."""
    hparams = {**dict(module.hparams), "_class_path": class_path}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, size in enumerate([(40, 32), (64, 64)]):  # one not square: resize + centre crop
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def _png(path: str) -> Image.Image:
    image = Image.open(path)
    assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100
    assert np.asarray(image.convert("L")).std() > 5  # not a blank canvas
    return image


def test_attention_tool_on_mae_clip_and_timm_files(images, tiny_clip_json, tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    clip = _lightning_file(CLIP(tiny_clip_json), "mmssl.models.clip.CLIP", tmp_path / "clip.ckpt")
    mae = MAE(**TINY_MAE)
    mae_file = _lightning_file(mae, "mmssl.models.mae.MAE", tmp_path / "mae.ckpt")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32, patch_size=8)
    torch.save(vit.state_dict(), tmp_path / "timm.pt")
    cases = {
        "clip": ["--ckpt", str(clip)],
        "mae": ["--ckpt", str(mae_file)],
        "timm": ["--ckpt", str(tmp_path / "timm.pt"), "--model", "vit_tiny_patch16_224",
                 "--model-kwargs", '{"img_size": 32, "patch_size": 8}'],
    }
    for name, ckpt in cases.items():
        assert run_tool("attention_maps.py", [*ckpt, "--images", *images, "--output", str(tmp_path / name)],
                        monkeypatch) == 0
        written = pngs(tmp_path / name)
        assert [Path(p).name for p in written] == ["img0_attention.png", "img1_attention.png"]
        assert capsys.readouterr().out.split() == written  # each path printed
        for path in written:
            _png(path)
    assert run_tool("attention_maps.py", ["--ckpt", str(clip), "--images", "nope.png", "--output", str(tmp_path)],
                    monkeypatch) == 1
    assert "nope.png" in capsys.readouterr().err


def test_attention_tool_keeps_same_named_images_apart(images, tmp_path, monkeypatch, capsys):
    # a/x.png and b/x.png: one output each (their paths below the common folder), not one file twice.
    for sub, source in (("a", images[0]), ("b", images[1])):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.png").write_bytes(Path(source).read_bytes())
    (tmp_path / "a" / "x.jpg").write_bytes(b"")
    mae = _lightning_file(MAE(**TINY_MAE), "mmssl.models.mae.MAE", tmp_path / "mae.ckpt")
    pair = [str(tmp_path / "a" / "x.png"), str(tmp_path / "b" / "x.png")]
    assert run_tool("attention_maps.py", ["--ckpt", str(mae), "--images", *pair, "--output", str(tmp_path / "out")],
                    monkeypatch) == 0
    written = pngs(tmp_path / "out")
    assert written == [str(tmp_path / "out" / "a" / "x_attention.png"), str(tmp_path / "out" / "b" / "x_attention.png")]
    assert _png(written[0]).tobytes() != _png(written[1]).tobytes()
    clash = [str(tmp_path / "a" / "x.png"), str(tmp_path / "a" / "x.jpg"), pair[1]]
    assert run_tool("attention_maps.py", ["--ckpt", str(mae), "--images", *clash, "--output", str(tmp_path / "o2")],
                    monkeypatch) == 1
    assert re.fullmatch(r"attention_maps: --images .*x\.png.* and .*x\.jpg.* would both .*\n", capsys.readouterr().err)
    assert not (tmp_path / "o2").exists()  # refused before anything is written


def test_similarity_tool_keeps_same_named_images_apart(images, tiny_clip_json, tmp_path, monkeypatch):
    # The clash attention_maps avoids: a/x.png and b/x.png wrote one x_similarity.png twice.
    for sub, source in (("a", images[0]), ("b", images[1])):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.png").write_bytes(Path(source).read_bytes())
    clip = _lightning_file(CLIP(tiny_clip_json), "mmssl.models.clip.CLIP", tmp_path / "clip.ckpt")
    pair = [str(tmp_path / "a" / "x.png"), str(tmp_path / "b" / "x.png")]
    assert run_tool("similarity_map.py", ["--ckpt", str(clip), "--images", *pair, "--text", "a star",
                                          "--output", str(tmp_path / "out")], monkeypatch) == 0
    assert pngs(tmp_path / "out") == [str(tmp_path / "out" / s / "x_similarity.png") for s in ("a", "b")]


def test_similarity_tool_writes_one_panel_per_query(images, tiny_clip_json, tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    clip = _lightning_file(CLIP(tiny_clip_json), "mmssl.models.clip.CLIP", tmp_path / "clip.ckpt")
    assert (
        run_tool(
            "similarity_map.py",
            [
                "--ckpt",
                str(clip),
                "--images",
                images[1],
                "--text",
                "a red star",
                "--text",
                "a blue circle",
                "--output",
                str(tmp_path / "sim"),
            ],
            monkeypatch,
        )
        == 0
    )
    one = _png(str(tmp_path / "sim" / "img1_similarity.png"))
    # --image: the old spelling, still accepted
    assert run_tool("similarity_map.py", ["--ckpt", str(clip), "--image", images[1], "--text", "a red star",
                                          "--output", str(tmp_path / "sim1")], monkeypatch) == 0
    assert one.size[0] > Image.open(tmp_path / "sim1" / "img1_similarity.png").size[0]  # a panel more
    mae = _lightning_file(MAE(**TINY_MAE), "mmssl.models.mae.MAE", tmp_path / "mae.ckpt")
    capsys.readouterr()
    assert run_tool("similarity_map.py", ["--ckpt", str(mae), "--images", images[0], "--text", "x",
                                          "--output", str(tmp_path)], monkeypatch) == 1
    assert capsys.readouterr().err == f"similarity_map: {mae}: MAE is not a CLIP: patch-text similarity needs a CLIP " \
                                      "checkpoint or an open_clip file\n"


def _fake_run(folder: Path, flops_per_step: float, losses: dict[int, float]) -> Path:
    """A run folder as mmssl writes it: CSVLogger's metrics.csv and RunSummary's compute.json."""
    folder.mkdir(parents=True)
    (folder / "compute.json").write_text(json.dumps({"flops_per_step": flops_per_step}))
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", "step", "train/loss", "val/loss"])
        for i, (step, loss) in enumerate(sorted(losses.items())):
            writer.writerow([i, step - 1, loss + 0.1, ""])  # Lightning's 0-based index of the last step
            writer.writerow([i, step - 1, "", loss])
    return folder


def test_scaling_tool_fits_and_plots(tmp_path, monkeypatch, capsys):
    a, b, c = 30.0, 0.1, 1.0
    runs = []
    rng = np.random.default_rng(0)
    for i, flops in enumerate(np.logspace(10, 13, 6)):  # 6 widths, 2 seeds each, 100 steps
        for seed in range(2):
            curve = {s: float(power_law(flops * s, a, b, c)) + rng.normal(0, 0.003) for s in (25, 50, 100)}
            runs.append(str(_fake_run(tmp_path / f"w{i}s{seed}" / "version_0", flops, curve)))
    out = tmp_path / "fit"
    assert run_tool("scaling_fit.py", [*runs, "--output", str(out), "--target-loss", "1.3"], monkeypatch) == 0
    report = json.loads((out / "scaling_fit.json").read_text())
    assert len(report["points"]) == 6 and all(p["runs"] == 2 for p in report["points"])
    assert report["b"] == pytest.approx(b, abs=max(4 * report["stderr"]["b"], 0.01))
    assert report["target_compute"] == pytest.approx((a / 0.3) ** (1 / b), rel=0.5)
    assert "b = " in capsys.readouterr().out
    for name in ("scaling_fit.png", "loss_vs_compute.png"):
        _png(str(out / name))


def _projector_rows(run: Path, tag: str) -> tuple[np.ndarray, list[str]]:
    folder = next(run.glob(f"*/{tag}"))
    return np.loadtxt(folder / "tensors.tsv", ndmin=2), (folder / "metadata.tsv").read_text().splitlines()


def test_projector_on_one_and_two_processes_writes_the_same_points(tiny_demo, tiny_clip_json, tmp_path):
    """The real CLI with validation on; 2 gloo ranks with uneven validation shares (3 shards)
    write the embeddings, labels and thumbnails one process writes. The run folder also holds
    RunSummary's compute.json, which tools/scaling_fit.py reads."""
    val = "::".join(str(p) for p in sorted(Path(tiny_demo.train).parent.glob("*.tar"))[:3])
    root = Path(tiny_demo.root)
    written = {}
    for processes in (1, 2):
        folder = tmp_path / f"p{processes}"
        folder.mkdir()
        ddp = ["--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT] if processes == 2 else []
        args = [
            "fit",
            "--config",
            str(REPO / "configs/demo/clip.yaml"),
            f"--model.init_args.model_name={tiny_clip_json}",
            f"--data.init_args.demo_dir={tiny_demo.root}",
            f"--data.init_args.val_data={val}",
            "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=1",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--model.init_args.optimizer.init_args.lr=0.0",
            f"--trainer.default_root_dir={folder / 'runs'}",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=mmssl.callbacks.EmbeddingProjector",
            f"--trainer.callbacks.data={val}",
            "--trainer.callbacks.batch_size=5",
            f"--trainer.callbacks.classnames={root / 'classnames.txt'}",
            f"--trainer.callbacks.templates={root / 'zeroshot_classification_templates.txt'}",
            "--trainer.callbacks.thumbnail_size=16",
            *ddp,
        ]
        out = run_mmssl(args, folder, timeout=420) if processes == 2 else run_one_process(args)
        assert out.returncode == 0, out.stdout[-3000:]
        run = folder / "runs" / "version_0"
        written[processes] = {tag: _projector_rows(run, tag) for tag in ("image", "image_text")}
        assert list(run.glob("*/image/sprite.png")) and (run / "projector_config.pbtxt").is_file()
        compute = json.loads((run / "compute.json").read_text())
        assert compute["world_size"] == processes and compute["flops_per_step"] > 0
        assert read_run(str(run)).flops_per_step == compute["flops_per_step"]
    one, two = written[1], written[2]
    tensors, labels = one["image"]
    assert tensors.shape == (48, 32) and len(labels) == 48  # 3 shards x 16 samples, 32-d embeddings
    assert set(labels) <= {f"{c} {s}" for c in ("red", "green", "blue", "yellow", "purple", "orange") for s in SHAPES}
    joint, kinds = one["image_text"]
    assert joint.shape == (48 + 36, 32) and kinds[0] == "kind\tclass" and kinds[-1].startswith("text\t")
    for tag in one:
        np.testing.assert_allclose(two[tag][0], one[tag][0], rtol=1e-4, atol=1e-5)
        assert two[tag][1] == one[tag][1]
