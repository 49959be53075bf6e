"""tools/export.py never replaces what it was not asked to: an existing file or a non-empty folder
is refused unless --overwrite, each path error names the path, and a refused export writes nothing."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import timm
import torch

from mmssl.models.mae import MAE
from tests.tiny import TINY_MAE

REPO = Path(__file__).resolve().parents[2]
def _main(argv) -> int:
    spec = importlib.util.spec_from_file_location("export_tool", REPO / "tools/export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in argv])


def export(*argv: str) -> None:
    assert _main(argv) == 0


def export_refused(*argv: str) -> str:
    """``tools/export.py ARGV`` that must fail: exit 1 and the one stderr line naming what is wrong."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _main(argv) == 1
    assert err.getvalue().startswith("export: ") and err.getvalue().count("\n") == 1, err.getvalue()
    return err.getvalue()


@pytest.fixture(scope="module")
def mae_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "mae.ckpt"
    mae = MAE(**TINY_MAE)
    torch.save({"state_dict": mae.state_dict(), "hyper_parameters": dict(mae.hparams)}, path)
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (the folder itself included in the names) and its bytes."""
    return {str(p.relative_to(folder.parent)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_existing_file_is_refused_unless_overwrite(mae_ckpt, tmp_path):
    out = tmp_path / "vit.pth"
    out.write_bytes(b"the user's file")
    refused = export_refused(  # FileExistsError
        "--ckpt", mae_ckpt, "--format", "timm", "--output", out
    )
    assert re.search(f"{out}.*--overwrite", refused)
    assert out.read_bytes() == b"the user's file"
    export("--ckpt", mae_ckpt, "--format", "timm", "--output", out, "--overwrite")
    state = torch.load(out, weights_only=True)
    assert "cls_token" in state and sorted(p.name for p in tmp_path.iterdir()) == ["vit.pth"]  # no temporary left


def test_folder_format_refuses_a_non_empty_folder_and_leaves_it_byte_identical(mae_ckpt, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"the": "user\'s config"}')
    (folder / "notes.txt").write_text("keep me")
    before = snapshot(folder)
    refused = export_refused(  # FileExistsError
        "--ckpt", mae_ckpt, "--format", "timm", "--output", folder
    )
    assert re.search(f"{folder}.*not empty.*config.json", refused)
    # --overwrite replaces only a folder of an earlier export: notes.txt is no export's file.
    refused = export_refused(  # FileExistsError
        "--ckpt", mae_ckpt, "--format", "timm", "--output", folder, "--overwrite"
    )
    assert re.search(f"{folder}.*notes.txt.*no export writes", refused)
    assert snapshot(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_overwrite_replaces_an_earlier_folder_export_whole(mae_ckpt, tmp_path):
    folder = tmp_path / "vit"
    export("--ckpt", mae_ckpt, "--format", "timm", "--output", f"{folder}/")  # the trailing slash of the docs
    (folder / "model.safetensors").write_bytes(b"stale")
    export("--ckpt", mae_ckpt, "--format", "timm", "--output", folder, "--overwrite")
    timm.create_model(f"local-dir:{folder}", pretrained=True)  # the new export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vit"]


def test_two_folder_formats_do_not_mix_in_one_folder(tiny_clip_json, tmp_path):
    from mmssl.models.clip import CLIP

    clip = CLIP(tiny_clip_json)
    torch.save({"state_dict": clip.state_dict(), "hyper_parameters": dict(clip.hparams)}, tmp_path / "clip.ckpt")
    folder = tmp_path / "clip_out"
    export("--ckpt", tmp_path / "clip.ckpt", "--format", "open_clip_hf", "--output", folder)
    before = snapshot(folder)
    refused = export_refused(  # FileExistsError
        "--ckpt", tmp_path / "clip.ckpt", "--format", "hf", "--output", folder
    )
    assert re.search(f"{folder}.*not empty", refused)
    assert snapshot(folder) == before
    # A file format pointed at a folder: an error naming it, not the zip writer's "Is a directory".
    refused = export_refused(  # IsADirectoryError
        "--ckpt", tmp_path / "clip.ckpt", "--format", "open_clip", "--output", folder
    )
    assert re.search(f"{folder}.*is a folder", refused)
    assert snapshot(folder) == before


def test_path_errors_name_the_path(mae_ckpt, tmp_path):
    refused = export_refused(  # FileNotFoundError
        "--ckpt", tmp_path / "none.ckpt", "--format", "timm", "--output", tmp_path / "x.pth"
    )
    assert re.search(str(tmp_path / "none.ckpt"), refused)
    (tmp_path / "afile").write_text("x")
    refused = export_refused(  # NotADirectoryError
        "--ckpt", mae_ckpt, "--format", "timm", "--output", tmp_path / "afile" / "vit.pth"
    )
    assert re.search(str(tmp_path / "afile"), refused)
    refused = export_refused(  # NotADirectoryError
        "--ckpt", mae_ckpt, "--format", "timm", "--output", tmp_path / "afile"
    )
    assert re.search(f"{tmp_path / 'afile'}.*writes a folder", refused)
    assert (tmp_path / "afile").read_text() == "x"


def test_a_refused_kind_leaves_an_earlier_export_as_it_was(mae_ckpt, tmp_path):
    folder = tmp_path / "vit"
    export("--ckpt", mae_ckpt, "--format", "timm", "--output", folder)
    before = snapshot(folder)
    refused = export_refused(  # ValueError
        "--ckpt", mae_ckpt, "--format", "open_clip_hf", "--output", folder, "--overwrite"
    )
    assert re.search("needs an mmssl CLIP or CLIPMLM checkpoint", refused)
    assert snapshot(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["vit"]


def test_timm_folder_does_not_claim_timms_pretrained_tag(mae_ckpt, tmp_path):
    export("--ckpt", mae_ckpt, "--format", "timm", "--output", tmp_path / "vit")
    text = (tmp_path / "vit" / "config.json").read_text()
    cfg = json.loads(text)["pretrained_cfg"]
    assert cfg["tag"] == "mmssl" and "mmssl MAE checkpoint" in cfg["description"]
    assert "augreg" not in text and "license" not in cfg and "hf_hub_id" not in cfg
    model = timm.create_model(f"local-dir:{tmp_path / 'vit'}", pretrained=True)
    assert model.pretrained_cfg["tag"] == "mmssl"
