"""A LoRA checkpoint made plain (mmssl.export.merge): the adapters merged into the base's weights,
the checkpoint's other entries kept, nothing left that would make a loader look for the base."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("peft")

from mmssl.checkpoints.layouts import kind_named  # noqa: E402
from mmssl.checkpoints.load import build_module  # noqa: E402
from mmssl.export.merge import merged_checkpoint  # noqa: E402
from mmssl.models.clip import CLIP  # noqa: E402


def test_a_lora_checkpoint_becomes_the_merged_model_with_its_other_entries_kept(tiny_clip_json, tmp_path):
    base = CLIP(model_name=tiny_clip_json)
    torch.save(base.model.state_dict(), tmp_path / "base.pth")
    lora = CLIP(model_name=tiny_clip_json, pretrained=str(tmp_path / "base.pth"), lora={"r": 4, "alpha": 8}).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts lora_B at zero: give the adapters a real update
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    checkpoint = {"state_dict": lora.state_dict(), "hyper_parameters": dict(lora.hparams), "epoch": 3}
    lora.on_save_checkpoint(checkpoint)
    assert checkpoint["lora_base"] and checkpoint["hyper_parameters"]["lora"]
    hparams_before = dict(checkpoint["hyper_parameters"])
    path = str(tmp_path / "lora.ckpt")

    kind = kind_named("CLIP")
    merged = merged_checkpoint(path, checkpoint, kind)
    assert "lora_base" not in merged and merged["epoch"] == 3
    assert checkpoint["lora_base"] and checkpoint["hyper_parameters"] == hparams_before  # the input is left whole
    hparams = merged["hyper_parameters"]
    assert set(hparams) == set(hparams_before)  # the same arguments: a plain model, no base files
    assert hparams["lora"] is None and hparams["pretrained"] is None and hparams["image_tower_init"] is None
    assert {k: v for k, v in hparams.items() if k not in ("lora", "pretrained")} == {
        k: v for k, v in hparams_before.items() if k not in ("lora", "pretrained")}
    assert not any("lora" in k for k in merged["state_dict"])

    plain = build_module(path, merged, kind)  # strict: the base's own keys, merged
    images, tokens = torch.randn(2, 3, 32, 32), lora.tokenizer(["a red square", "a blue circle"])
    with torch.no_grad():
        adapted, merged_out = lora(images, tokens), plain(images, tokens)
        untouched = base.eval()(images, tokens)
    torch.testing.assert_close(merged_out["image_features"], adapted["image_features"], rtol=0, atol=1e-5)
    torch.testing.assert_close(merged_out["text_features"], adapted["text_features"], rtol=0, atol=1e-5)
    assert (merged_out["image_features"] - untouched["image_features"]).abs().max() > 1e-3

    assert merged_checkpoint(path, merged, kind) is merged  # no adapters: returned as it is
    no_base = dict(merged, lora_base=None)
    assert merged_checkpoint(path, no_base, kind) is no_base

    # A base changed since training: the export is refused, naming the checkpoint and the base.
    changed = torch.load(tmp_path / "base.pth", weights_only=True)
    changed["logit_scale"] += 1
    torch.save(changed, tmp_path / "base.pth")
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: the LoRA base file .*base.pth .*has changed"):
        merged_checkpoint(path, checkpoint, kind)
