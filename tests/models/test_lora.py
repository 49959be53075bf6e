"""LoRA (mmssl.models.lora): what trains, refusals, checkpoints with a checked base, exports that
load with no peft installed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import open_clip
import pytest
import timm
import torch

pytest.importorskip("peft")

from mmssl.checkpoints.load import load_lightning  # noqa: E402
from mmssl.export import export_checkpoint  # noqa: E402
from mmssl.models.classifier import ImageClassifier  # noqa: E402
from mmssl.models.clip import CLIP  # noqa: E402

VIT = dict(model_name="vit_tiny_patch16_224", image_size=32, num_classes=3, mixup=0.0, cutmix=0.0,
           model_kwargs=dict(patch_size=8, embed_dim=32, depth=2, num_heads=2))


def _perturb_adapters(module: torch.nn.Module) -> None:
    """peft starts lora_B at zero (the adapted model is the base); give the adapters a real update."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name or "head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _save(module, path) -> None:
    """What Lightning's checkpoint connector writes, through the module's own hook."""
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)


@pytest.fixture(scope="module")
def clip_base(tiny_clip_json, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_base")
    base = CLIP(model_name=tiny_clip_json)
    torch.save(base.model.state_dict(), folder / "base.pth")
    return tiny_clip_json, folder / "base.pth"


def test_lora_trains_adapters_and_logit_scale_only_and_refuses_names_that_match_nothing(clip_base):
    json_path, base = clip_base
    module = CLIP(model_name=json_path, pretrained=str(base), lora={"r": 4})
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert "model.logit_scale" in trainable
    assert all("lora_" in n for n in trainable if n != "model.logit_scale"), trainable
    adapted = {n.split(".lora_")[0] for n in trainable if "lora_A" in n}
    # open_clip towers: the attention (in_proj and out_proj together) and both MLP layers, image and text
    assert {
        "model.visual.transformer.resblocks.0.attn",
        "model.visual.transformer.resblocks.0.attn.base_layer.out_proj",
        "model.visual.transformer.resblocks.0.mlp.c_fc",
        "model.transformer.resblocks.0.mlp.c_proj",
    } <= adapted
    text_only = CLIP(
        model_name=json_path, pretrained=str(base), lora={"r": 2, "towers": ["text"], "target_modules": ["c_fc"]}
    )
    assert {n.split(".lora_")[0] for n, _ in text_only.named_parameters() if "lora_A" in n} == {
        "model.transformer.resblocks.0.mlp.c_fc"}
    with pytest.raises(
        ValueError, match=r"'qkv' matches no Linear or MultiheadAttention.*candidates: .*'attn'.*'mlp.c_fc'"
    ):
        CLIP(model_name=json_path, pretrained=str(base), lora={"target_modules": ["qkv"]})
    with pytest.raises(ValueError, match="model.lora needs model.pretrained"):
        CLIP(model_name=json_path, lora={"r": 4})
    with pytest.raises(ValueError, match=r"unknown keys \['rank'\]"):
        CLIP(model_name=json_path, pretrained=str(base), lora={"rank": 4})


def test_lora_classifier_adapts_the_vit_blocks_and_trains_the_head(tmp_path):
    encoder = ImageClassifier(**VIT).model
    encoder.reset_classifier(0)
    torch.save(encoder.state_dict(), tmp_path / "vit.pth")
    module = ImageClassifier(**VIT, init_encoder=str(tmp_path / "vit.pth"), lora={"r": 2})
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert {"model.head.weight", "model.head.bias", "model.fc_norm.weight"} <= trainable
    adapted = {n.split(".lora_")[0] for n in trainable if "lora_A" in n}
    assert adapted == {
        f"model.blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    }
    assert not any("lora" in n for n, _ in module.model.patch_embed.named_parameters())


def test_lora_checkpoint_holds_what_trains_and_refuses_a_missing_or_changed_base(clip_base, tmp_path):
    json_path, base = clip_base
    own_base = tmp_path / "base.pth"
    own_base.write_bytes(base.read_bytes())
    module = CLIP(model_name=json_path, pretrained=str(own_base), lora={"r": 4}).eval()
    _perturb_adapters(module)
    _save(module, tmp_path / "lora.ckpt")
    saved = torch.load(tmp_path / "lora.ckpt", weights_only=True)
    assert set(saved["state_dict"]) == {n for n, p in module.named_parameters() if p.requires_grad}
    assert saved["lora_base"]["pretrained"]["path"] == str(own_base)
    images, tokens = torch.randn(2, 3, 32, 32), module.tokenizer(["a red square", "a blue circle"])
    loaded = load_lightning(str(tmp_path / "lora.ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(images, tokens)["image_features"], module(images, tokens)["image_features"])
    # A resume (Lightning's on_load_checkpoint) on another base is refused before any weight loads.
    other = CLIP(model_name=json_path, pretrained=str(base), lora={"r": 4})
    other.lora_base = {"pretrained": dict(saved["lora_base"]["pretrained"], sha256="0" * 64)}
    with pytest.raises(ValueError, match="resuming a LoRA run on another base"):
        other.on_load_checkpoint(saved)
    changed = torch.load(own_base, weights_only=True)
    changed["logit_scale"] += 1
    torch.save(changed, own_base)
    with pytest.raises(ValueError, match=re.escape(f"the LoRA base file {own_base} (model.pretrained) has changed")):
        load_lightning(str(tmp_path / "lora.ckpt"))
    own_base.unlink()
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"the LoRA base file {own_base} (model.pretrained) is missing")
    ):
        load_lightning(str(tmp_path / "lora.ckpt"))


def _without_peft(monkeypatch) -> None:
    """From here on any ``import peft`` (or of a submodule) raises ImportError, as with peft uninstalled."""
    for name in [n for n in sys.modules if n == "peft" or n.startswith("peft.")] or ["peft"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_every_export_merges_the_adapters_and_loads_with_no_peft(clip_base, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    json_path, base = clip_base
    clip = CLIP(model_name=json_path, pretrained=str(base), lora={"r": 4}).eval()
    _perturb_adapters(clip)
    _save(clip, tmp_path / "clip.ckpt")
    encoder = ImageClassifier(**VIT).model
    encoder.reset_classifier(0)
    torch.save(encoder.state_dict(), tmp_path / "vit_base.pth")
    vit = ImageClassifier(**VIT, init_encoder=str(tmp_path / "vit_base.pth"), lora={"r": 2}).eval()
    _perturb_adapters(vit)
    _save(vit, tmp_path / "vit.ckpt")
    export_checkpoint(str(tmp_path / "clip.ckpt"), "open_clip", str(tmp_path / "clip.pth"))
    export_checkpoint(str(tmp_path / "clip.ckpt"), "hf", str(tmp_path / "clip_hf"))
    export_checkpoint(str(tmp_path / "vit.ckpt"), "timm", str(tmp_path / "vit.pth"))
    images = torch.randn(2, 3, 32, 32)
    tokens = clip.tokenizer(["a red square", "a blue circle"])
    with torch.no_grad():
        image, text = clip.encode_image(images, normalize=False), clip.encode_text(tokens, normalize=False)
        logits = vit(images)
        plain = CLIP(model_name=json_path, pretrained=str(base)).eval().encode_image(images, normalize=False)
    assert (image - plain).abs().max() > 1e-2  # the adapters changed the model: the merge is seen

    _without_peft(monkeypatch)
    with pytest.raises(ImportError):
        import peft  # noqa: F401
    open_clip.add_model_config(json_path)
    oc = open_clip.create_model(Path(json_path).stem, pretrained=str(tmp_path / "clip.pth")).eval()
    hf = transformers.CLIPModel.from_pretrained(str(tmp_path / "clip_hf")).eval()
    timm_vit = timm.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32, global_pool="avg",
                                 **VIT["model_kwargs"])
    timm_vit.load_state_dict(torch.load(tmp_path / "vit.pth", weights_only=True))  # strict: no adapter keys
    with torch.no_grad():
        hf_image = hf.get_image_features(pixel_values=images)
        hf_image = getattr(hf_image, "pooler_output", hf_image)  # transformers 5: an output object
        torch.testing.assert_close(oc.encode_image(images), image, rtol=0, atol=1e-5)
        torch.testing.assert_close(oc.encode_text(tokens), text, rtol=0, atol=1e-5)
        torch.testing.assert_close(hf_image, image, rtol=0, atol=1e-5)
        torch.testing.assert_close(timm_vit.eval()(images), logits, rtol=0, atol=1e-5)


def test_wise_ft_mixes_a_lora_end_as_its_merged_weights(clip_base, tmp_path):
    """A LoRA fine-tune is a WiSE-FT end (tools/wise_ft.py): its adapters are merged before mixing,
    so alpha 1 computes what the adapted model computes and alpha 0.5 is the plain mean."""
    from mmssl.evaluation.wise_ft import Pair

    json_path, base = clip_base
    _save(CLIP(model_name=json_path, pretrained=str(base)).eval(), tmp_path / "start.ckpt")
    lora = CLIP(model_name=json_path, pretrained=str(base), lora={"r": 4}).eval()
    _perturb_adapters(lora)
    _save(lora, tmp_path / "lora.ckpt")
    pair = Pair(str(tmp_path / "start.ckpt"), str(tmp_path / "lora.ckpt"))
    start, end, half = (pair.mix(a).state_dict() for a in (0.0, 1.0, 0.5))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(pair.mix(1.0).encode_image(images), lora.encode_image(images), rtol=0, atol=1e-5)
    moved = [k for k in start if start[k].is_floating_point() and not torch.equal(start[k], end[k])]
    assert any("attn" in k for k in moved) and any("c_fc" in k for k in moved)  # adapters merged into both kinds
    for key in moved:
        torch.testing.assert_close(half[key], 0.5 * (start[key] + end[key]))


def test_adapters_are_scaled_by_alpha_over_r_in_the_model_and_in_every_merge(clip_base, tmp_path):
    """r 2, alpha 8: each adapted layer computes ``W x + (alpha / r) B A x`` (LoRA eq. 3), and the
    exported weights are ``W + (alpha / r) B A``, for a Linear (c_fc) and an attention's in_proj."""
    json_path, base = clip_base
    clip = CLIP(model_name=json_path, pretrained=str(base), lora={"r": 2, "alpha": 8}).eval()
    _perturb_adapters(clip)
    plain = CLIP(model_name=json_path, pretrained=str(base)).model.state_dict()
    block = "visual.transformer.resblocks.0"
    fc = clip.model.get_submodule(f"{block}.mlp.c_fc")
    a, b = fc.lora_A["default"].weight, fc.lora_B["default"].weight  # (r, in), (out, r)
    assert a.shape[0] == 2 and b.abs().max() > 0
    fc_weight = plain[f"{block}.mlp.c_fc.weight"] + 4.0 * b @ a
    x = torch.randn(3, a.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(fc(x), x @ fc_weight.T + plain[f"{block}.mlp.c_fc.bias"], rtol=0, atol=1e-5)
    attn = clip.model.get_submodule(f"{block}.attn")
    in_a, in_b = attn.lora_A["default"].weight, attn.lora_B["default"].weight
    in_proj = plain[f"{block}.attn.in_proj_weight"] + 4.0 * in_b @ in_a
    _save(clip, tmp_path / "lora.ckpt")
    state = export_checkpoint(str(tmp_path / "lora.ckpt"), "open_clip", str(tmp_path / "clip.pth"))
    torch.testing.assert_close(state[f"{block}.mlp.c_fc.weight"], fc_weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(state[f"{block}.attn.in_proj_weight"], in_proj, rtol=0, atol=1e-6)
