"""tools/zero_shot.py and tools/linear_probe.py take an export folder as ``--ckpt``, as
tools/evaluate.py does: the folder scores as the checkpoint it was exported from (an open_clip hub
folder's zero-shot and embedding probe, a timm folder's token and per-block probes), and a feature
the folder cannot give is refused in one line before any image is read."""

from __future__ import annotations

import json

import pytest
import torch

from mmssl.evaluation.encoders import load_encoder
from mmssl.evaluation.features import image_features
from mmssl.export import export_checkpoint
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE
from tests.cli_runs import run_tool
from tests.data.image_helpers import image_bytes, write_image_folder
from tests.tiny import TINY_MAE

VARYING = ("checkpoint", "model", "seconds")  # the path, the class that read it, the time


def _report(tool: str, args: list[str], out, monkeypatch) -> dict:
    assert run_tool(tool, [*args, "--output-json", str(out)], monkeypatch) == 0
    return {k: v for k, v in json.loads(out.read_text()).items() if k not in VARYING}


def _lightning(module, path):
    hparams = {**dict(module.hparams), "_class_path": f"{type(module).__module__}.{type(module).__name__}"}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, path)
    return str(path)


CLASSES = ["cat", "dog", "red_fox"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return str(write_image_folder(tmp_path_factory.mktemp("set") / "set", CLASSES, 4))


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Other images of the same classes: the probes' figures are not all 1 (a wrong model would show)."""
    root = tmp_path_factory.mktemp("held_out")
    for c, name in enumerate(CLASSES):
        (root / name).mkdir()
        for i in range(5):
            (root / name / f"{i:03d}.png").write_bytes(image_bytes(1000 + 7 * c + i, "PNG", 8))
    return str(root)


def test_an_open_clip_hub_folder_scores_as_its_checkpoint(tiny_clip_json, images, held_out, tmp_path, monkeypatch,
                                                          capsys):
    torch.manual_seed(0)
    ckpt = _lightning(CLIP(tiny_clip_json), tmp_path / "clip.ckpt")
    folder = str(tmp_path / "oc")
    export_checkpoint(ckpt, "open_clip_hf", folder)
    for tool, args in [("zero_shot.py", ["--data", images]),
                       ("linear_probe.py", ["--train-data", images, "--val-data", held_out, "--feature", "embedding"])]:
        theirs = _report(tool, ["--ckpt", folder, *args], tmp_path / "folder.json", monkeypatch)
        ours = _report(tool, ["--ckpt", ckpt, *args], tmp_path / "ckpt.json", monkeypatch)
        assert theirs == ours and 0 < theirs["top1"] < 1
    capsys.readouterr()
    probe = ["--ckpt", folder, "--train-data", images, "--val-data", images]
    assert run_tool("linear_probe.py", probe, monkeypatch) == 1  # the default feature is the cls token
    assert capsys.readouterr().err == (
        "linear_probe: feature 'cls' pools the image tower's tokens, which OpenClipEncoder does not give "
        "(no forward_features): probe its embedding (--feature embedding)\n")
    assert run_tool("linear_probe.py", [*probe, "--feature", "embedding", "--all-layers"], monkeypatch) == 1
    assert capsys.readouterr().err.startswith("linear_probe: OpenClipEncoder has no forward_intermediates")


def test_a_timm_folder_probes_its_tokens_and_blocks_as_its_checkpoint(images, held_out, tmp_path, monkeypatch):
    torch.manual_seed(0)
    ckpt = _lightning(MAE(**{**TINY_MAE, "depth": 2}), tmp_path / "mae.ckpt")
    folder = str(tmp_path / "timm")
    export_checkpoint(ckpt, "timm", folder)
    args = ["--train-data", images, "--val-data", held_out, "--all-layers", "--feature", "avg", "--knn-k", "3"]
    theirs = _report("linear_probe.py", ["--ckpt", folder, *args], tmp_path / "folder.json", monkeypatch)
    ours = _report("linear_probe.py", ["--ckpt", ckpt, *args], tmp_path / "ckpt.json", monkeypatch)
    assert [layer["block"] for layer in ours["layers"]] == [1, 2] and 0 < ours["knn_top1"] < 1
    # pytest >= 9.1 refuses approx over nested dicts: the per-block figures are compared a block at a time.
    assert {k: v for k, v in theirs.items() if k != "layers"} == pytest.approx(
        {k: v for k, v in ours.items() if k != "layers"}, abs=1e-6)
    assert len(theirs["layers"]) == len(ours["layers"])
    for a, b in zip(theirs["layers"], ours["layers"]):
        assert a == pytest.approx(b, abs=1e-6)
    # The figures of a dozen images are coarse (another random MAE can tie them): the features are exact.
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for feature, layers in [("avg", True), ("cls", True), ("embedding", False)]:
            for a, b in zip(image_features(load_encoder(folder), x, feature, layers),
                            image_features(load_encoder(ckpt), x, feature, layers), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
