"""mmssl.checkpoints: files are read as data; a pickle that would run code is refused everywhere."""

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmssl.checkpoints import UnsafeCheckpointError, read_checkpoint, read_state_dict
from mmssl.checkpoints.load import load_lightning
from mmssl.models.mae import MAE
from tests.cli_runs import run_tool

TINY = dict(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4,
            decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=4)


class SystemPayload:
    """Unpickling calls ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class OpenPayload:
    """Unpickling calls ``open(MARKER, "w")``, creating the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def craft(tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    """A file shaped like an mmssl checkpoint with a payload among its hyper-parameters.

    Returns (file, marker the payload would create, the global it names)."""
    marker = tmp_path / f"pwned_{kind}"
    state = MAE(**TINY).state_dict()
    if kind == "zip":  # torch.save's default format
        path, payload, name = tmp_path / "evil.ckpt", SystemPayload(marker), f"{os.system.__module__}.system"
        torch.save(
            {"state_dict": state, "hyper_parameters": {"_class_path": "mmssl.models.mae.MAE", "x": payload}}, path
        )
    else:  # a bare pickle: torch.load's legacy path
        path, payload, name = tmp_path / "evil.pth", OpenPayload(marker), f"{open.__module__}.open"
        with open(path, "wb") as f:
            pickle.dump({"state_dict": state, "hyper_parameters": {"x": payload}}, f)
    return path, marker, name


@pytest.fixture(params=["zip", "legacy"])
def evil(tmp_path, request):
    return craft(tmp_path, request.param)


def test_crafted_files_do_run_code_when_fully_unpickled(tmp_path):
    # The control: without weights_only each file executes its payload.
    for kind in ("zip", "legacy"):
        path, marker, _ = craft(tmp_path, kind)
        if kind == "zip":
            torch.load(path, map_location="cpu", weights_only=False)
        else:
            with open(path, "rb") as f:
                pickle.load(f)
        assert marker.exists()


def test_read_checkpoint_refuses_and_names_file_and_global(evil):
    path, marker, name = evil
    with pytest.raises(UnsafeCheckpointError) as error:
        read_checkpoint(str(path))
    assert str(path) in str(error.value) and name in str(error.value)
    assert not marker.exists()


@pytest.mark.parametrize("tool,args", [
    ("export.py", ["--format", "timm", "--output", "{tmp}/out.pth"]),
    ("export.py", ["--format", "open_clip", "--output", "{tmp}/out.safetensors"]),
    ("linear_probe.py", ["--train-data", "{tmp}", "--val-data", "{tmp}"]),
    ("linear_probe.py", ["--model", "vit_tiny_patch16_224", "--train-data", "{tmp}", "--val-data", "{tmp}"]),
    ("linear_probe.py", ["--model-class", "MAE", "--train-data", "{tmp}", "--val-data", "{tmp}"]),
    ("zero_shot.py", ["--data", "{tmp}"]),
    ("zero_shot.py", ["--model", "{clip_json}", "--data", "{tmp}"]),
    ("export.py", ["--format", "hf", "--output", "{tmp}/hf"]),
    ("export.py", ["--format", "open_clip_hf", "--output", "{tmp}/hub"]),
    ("attention_maps.py", ["--images", "{tmp}/x.png", "--output", "{tmp}/maps"]),
    ("similarity_map.py", ["--images", "{tmp}/x.png", "--text", "a star", "--output", "{tmp}/maps"]),
])
def test_every_ckpt_tool_refuses(tool, args, evil, tiny_clip_json, tmp_path, monkeypatch, capsys):
    path, marker, name = evil
    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")  # the image tools check --images before --ckpt
    args = [a.format(tmp=tmp_path, clip_json=tiny_clip_json) for a in args]
    assert run_tool(tool, ["--ckpt", str(path), *args], monkeypatch) == 1  # UnsafeCheckpointError, one line
    err = capsys.readouterr().err
    assert err.startswith(f"{tool[:-3]}: ") and str(path) in err and name in err and err.count("\n") == 1
    assert not marker.exists()
    assert not (tmp_path / "out.pth").exists() and not (tmp_path / "out.safetensors").exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hub").exists() and not (tmp_path / "maps").exists()


def test_init_encoder_and_pretrained_refuse(evil, tiny_clip_json):
    from mmssl.models.clip import CLIP

    path, marker, name = evil
    with pytest.raises(UnsafeCheckpointError, match=name):
        MAE(**TINY, init_encoder=str(path))
    from mmssl.models.classifier import ImageClassifier

    with pytest.raises(UnsafeCheckpointError, match=name):  # fine-tuning's --model.init_encoder
        ImageClassifier(init_encoder=str(path))
    # open_clip reads `pretrained` itself, also with weights_only=True.
    with pytest.raises(pickle.UnpicklingError):
        CLIP(model_name=tiny_clip_json, pretrained=str(path))
    assert not marker.exists()


def write_ckpt(path: Path, class_path: str | None = "mmssl.models.mae.MAE") -> MAE:
    model = MAE(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    hparams = dict(model.hparams)
    if class_path is not None:
        hparams["_class_path"] = class_path
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": hparams}, path)
    return model


def test_load_lightning_builds_the_recorded_class_with_its_weights(tmp_path):
    model = write_ckpt(tmp_path / "mae.ckpt")
    loaded = load_lightning(str(tmp_path / "mae.ckpt"))
    assert type(loaded) is MAE and not loaded.training
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(images), model.encode_image(images), rtol=0, atol=0)


def test_class_path_outside_allow_list_is_refused_not_imported(tmp_path):
    write_ckpt(tmp_path / "a.ckpt", class_path="mmssl_evil_module.Evil")
    with pytest.raises(ValueError, match="not one mmssl loads"):
        load_lightning(str(tmp_path / "a.ckpt"))
    # Same from a run's config.yaml, and from an explicit override.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    write_ckpt(run / "checkpoints" / "last.ckpt", class_path=None)
    (run / "config.yaml").write_text("model:\n  class_path: mmssl_evil_module.Evil\n")
    with pytest.raises(ValueError, match="not one mmssl loads"):
        load_lightning(str(run / "checkpoints" / "last.ckpt"))
    with pytest.raises(ValueError, match="not one mmssl loads"):
        load_lightning(str(tmp_path / "a.ckpt"), model_class="os.system")
    assert "mmssl_evil_module" not in sys.modules
    # The override may name an allowed class, by its short name too.
    assert type(load_lightning(str(tmp_path / "a.ckpt"), model_class="MAE")) is MAE


def test_read_state_dict_unwraps_and_reads_safetensors(tmp_path):
    from safetensors.torch import save_file

    state = {"w": torch.arange(4.0), "b": torch.ones(2)}
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "ddp.pth")
    save_file(state, tmp_path / "w.safetensors")
    for name in ("ddp.pth", "w.safetensors"):
        got = read_state_dict(str(tmp_path / name))
        assert got.keys() == state.keys()
        for k in state:
            torch.testing.assert_close(got[k], state[k])
    mapped = read_checkpoint(str(tmp_path / "ddp.pth"), mmap=True)["model"]
    torch.testing.assert_close(mapped["module.w"], state["w"])
    with pytest.raises(FileNotFoundError, match="none.pth"):
        read_checkpoint(str(tmp_path / "none.pth"))
