"""One table of model kinds (mmssl.checkpoints.layouts.KINDS): every LightningModule of the package
has its row; loading, exporting and fine-tuning initialisation agree on it; detection does not
depend on the rows' order; every kind exports to every format its row lists, and any other format
is refused naming the ones it has."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import timm
import torch

import mmssl
from mmssl.checkpoints import layouts, load
from mmssl.checkpoints.layouts import KINDS, detect_kind, kind_named
from mmssl.export import EXPORTERS, FOLDER_EXPORTERS, FORMATS, export_checkpoint
from mmssl.export.hub import TIMM_MODELS
from mmssl.models import ImageClassifier
from mmssl.models.m3ae import M3AE
from mmssl.models.mae import MAE
from tests.tiny import TINY_MAE

TINY_M3AE = dict(TINY_MAE, text_length=8)
TINY_VIT = dict(num_classes=3, model_name="vit_tiny_patch16_224", image_size=32, mixup=0.0, cutmix=0.0,
                model_kwargs=dict(patch_size=8, embed_dim=32, depth=1, num_heads=2))


def _save(module: torch.nn.Module, path: Path) -> Path:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


# CLIPMLM's text tower is bidirectional, with a row for the mask token.
TINY_CLIP_MLM = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16,
                                                 "patch_size": 8},
                 "text_cfg": {"context_length": 16, "vocab_size": 49409, "width": 32, "heads": 2, "layers": 1,
                              "no_causal_mask": True}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_clip_json, tiny_coca_json) -> dict[str, tuple[torch.nn.Module, Path]]:
    """A checkpoint of each kind of the table, recording no class (the weights tell the kind)."""
    from mmssl.models.clip import CLIP
    from mmssl.models.clip_mlm import CLIPMLM
    from mmssl.models.coca import CoCa

    folder = tmp_path_factory.mktemp("kinds")
    (folder / "clip_mlm_test_tiny.json").write_text(json.dumps(TINY_CLIP_MLM))
    modules = {"MAE": MAE(**TINY_MAE), "CLIP": CLIP(tiny_clip_json), "ImageClassifier": ImageClassifier(**TINY_VIT),
               "CoCa": CoCa(tiny_coca_json), "M3AE": M3AE(**TINY_M3AE),
               "CLIPMLM": CLIPMLM(str(folder / "clip_mlm_test_tiny.json"))}
    return {name: (m.eval(), _save(m, folder / f"{name}.ckpt")) for name, m in modules.items()}


def _lightning_modules() -> set[str]:
    """Class paths of the LightningModule subclasses the mmssl package defines (every module imported)."""
    for info in pkgutil.walk_packages(mmssl.__path__, "mmssl."):
        if info.name != "mmssl.__main__":
            importlib.import_module(info.name)

    def subclasses(cls: type) -> set[type]:
        return {c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))}

    return {f"{c.__module__}.{c.__qualname__}" for c in subclasses(pl.LightningModule)
            if c.__module__.startswith("mmssl.")}


def test_every_lightning_module_of_the_package_has_its_row():
    assert _lightning_modules() == {kind.class_path for kind in KINDS}


def test_the_table_covers_every_module_and_every_format_it_lists_has_a_writer(checkpoints):
    assert sorted(k.name for k in KINDS) == sorted(checkpoints)  # the fixture has one of each
    for kind in KINDS:
        module, _ = checkpoints[kind.name]
        assert detect_kind(module.state_dict()) is kind
        assert load.module_class(kind) is type(module)
        assert kind_named(kind.name) is kind_named(kind.class_path) is kind_named(f"mmssl.models.{kind.name}") is kind
        assert set(kind.formats) <= set(FORMATS)
        if "timm" in kind.formats:  # a file and a folder
            assert kind.name in TIMM_MODELS and "timm" in EXPORTERS and "timm" in FOLDER_EXPORTERS
            assert kind.vit is not None and kind.timm is not None
        if {"open_clip", "open_clip_hf", "hf"} & set(kind.formats):
            assert kind.open_clip is not None
    assert set(TIMM_MODELS) == set(layouts.kinds_for("timm"))
    assert kind_named("mmssl_evil.Evil") is None


def test_detection_does_not_depend_on_the_order_of_the_rows(checkpoints):
    rows = list(KINDS)
    orders = [rows[i:] + rows[:i] for i in range(len(rows))]  # each row first once, forwards and backwards
    for order in orders + [order[::-1] for order in orders]:
        for name, (module, _) in checkpoints.items():
            assert detect_kind(module.state_dict(), order).name == name
    # An M3AE has an encoder and a decoder too; a CoCa has a CLIP's logit scale: the more specific row wins.
    assert detect_kind({"encoder.cls_token": 0, "decoder.x": 0}).name == "MAE"
    assert detect_kind({"model.logit_scale": 0, "model.text_decoder.x": 0}).name == "CoCa"
    # Keys of two kinds neither of which is the more specific: refused, never the first row's.
    with pytest.raises(ValueError, match="fit several model kinds.*--model-class"):
        detect_kind({"model.logit_scale": 0, "model.head.weight": 0})


def test_tools_export_docstring_lists_every_kind_with_exactly_its_formats():
    """The table in tools/export.py's help: one row per kind, ``NAME  format (note), format ...``,
    whose formats (the words outside parentheses; ``none`` for none) are the row's of KINDS."""
    import re
    import runpy

    doc = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "export.py"))["__doc__"]
    names = {kind.name for kind in KINDS}
    rows = {line.split()[0]: line.split(None, 1)[1] for line in doc.splitlines()
            if line.startswith("    ") and line.split() and line.split()[0] in names}
    assert set(rows) == names
    for kind in KINDS:
        listed = set(re.sub(r"\([^)]*\)", " ", rows[kind.name]).replace(",", " ").split()) - {"none"}
        assert listed == set(kind.formats), (kind.name, rows[kind.name])


def test_a_format_a_kind_cannot_hold_is_refused_naming_its_formats(checkpoints, tmp_path):
    for kind in KINDS:
        _, ckpt = checkpoints[kind.name]
        for format in FORMATS:
            if format in kind.formats:
                continue
            outputs = [tmp_path / f"{kind.name}_{format}"]
            if format in EXPORTERS:
                outputs.append(tmp_path / f"{kind.name}_{format}.pth")
            for out in outputs:
                says = f"--format {kind.formats[0]}" if kind.formats else ""
                with pytest.raises(ValueError, match=f"not a {kind.name} one.*{says}"):
                    export_checkpoint(str(ckpt), format, str(out))
                assert not out.exists()


def test_image_classifier_exports_to_a_timm_folder_that_timm_loads(checkpoints, tmp_path):
    module, ckpt = checkpoints["ImageClassifier"]
    folder = tmp_path / "ft_timm"
    export_checkpoint(str(ckpt), "timm", str(folder))
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "vit_tiny_patch16_224" and config["pretrained_cfg"]["tag"] == "mmssl"
    assert "ImageClassifier.ckpt" in config["pretrained_cfg"]["description"]
    vit = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(vit(images), module(images), rtol=0, atol=1e-5)
    assert timm.data.resolve_data_config(model=vit)["mean"] == pytest.approx(module.image_mean)


def test_a_folder_export_reads_the_checkpoint_once(checkpoints, tmp_path, monkeypatch):
    from mmssl.checkpoints import model_file

    reads = []
    real = model_file.read_checkpoint
    monkeypatch.setattr(model_file, "read_checkpoint", lambda path, **kw: reads.append(path) or real(path, **kw))
    export_checkpoint(str(checkpoints["MAE"][1]), "timm", str(tmp_path / "vit"))
    assert reads == [str(checkpoints["MAE"][1])]


def test_fine_tuning_starts_from_every_kind_with_a_vit(checkpoints):
    mae, mae_ckpt = checkpoints["MAE"]
    classifier, ft_ckpt = checkpoints["ImageClassifier"]
    from_mae = ImageClassifier(**TINY_VIT, global_pool="token", init_encoder=str(mae_ckpt))
    torch.testing.assert_close(from_mae.model.blocks[0].attn.qkv.weight, mae.encoder.blocks[0].attn.qkv.weight)
    from_ft = ImageClassifier(**TINY_VIT, init_encoder=str(ft_ckpt))  # same head shape: kept
    torch.testing.assert_close(from_ft.model.head.weight, classifier.model.head.weight)
    # The same loader fills an MAE's encoder; an avg-pooled classifier has no final norm to give it.
    with pytest.raises(KeyError, match="ImageClassifier.ckpt.*lacks encoder weights.*norm"):
        MAE(**TINY_MAE, init_encoder=str(ft_ckpt))
    with pytest.raises(ValueError, match="CLIP.ckpt.*open_clip's own ViT"):
        ImageClassifier(**TINY_VIT, init_encoder=str(checkpoints["CLIP"][1]))
