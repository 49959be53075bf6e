"""The edges of mmssl.models.lora that tests/models/test_lora.py leaves open: ``model.lora``'s
defaults and each refusal's exact message, the towers of an open_clip model with a timm trunk and a
separate text tower, globs and the ``trainable`` option, dropout reaching the adapters, a merge
refusing a NaN adapter (Linear and attention), the base files' checksums and messages, and a
resume's checks of the trained tensors and the base."""

from __future__ import annotations

import hashlib
import os
import re
import sys

import pytest
import torch
from open_clip.model import CustomTextCLIP
from torch import nn

pytest.importorskip("peft")

from mmssl.models.clip import CLIP  # noqa: E402
from mmssl.models.lora import (  # noqa: E402
    CLIP_TRAINABLE,
    LORA_BASE,
    LoraSpec,
    Tower,
    base_reference,
    check_base,
    clip_towers,
    has_lora,
    inject_lora,
    load_trained_state,
    merge_lora,
    parse_lora,
    resolve_targets,
    sha256_file,
)


@pytest.fixture(scope="module")
def clip_base(tiny_clip_json, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_base")
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), folder / "base.pth")
    return tiny_clip_json, folder / "base.pth"


def _refused(config: dict, towers=("image", "text")) -> str:
    with pytest.raises(ValueError) as info:
        parse_lora(config, list(towers))
    return str(info.value)


def test_lora_options_take_their_defaults_and_each_refusal_names_the_key():
    assert parse_lora({}, ["image"]) == LoraSpec(r=8, alpha=8.0, dropout=0.0)
    spec = parse_lora({"r": 4, "target_modules": "c_fc", "towers": ["text"], "trainable": "logit_*"}, ["image", "text"])
    assert spec == LoraSpec(r=4, alpha=4.0, target_modules=("c_fc",), towers=("text",), trainable=("logit_*",))
    assert parse_lora({"r": 2, "alpha": 16, "dropout": 0.5}, ["image"]) == LoraSpec(r=2, alpha=16.0, dropout=0.5)
    assert parse_lora({"r": 1}, ["image"]).r == 1
    assert _refused({"rank": 4, "alph": 1}) == (
        "model.lora: unknown keys ['alph', 'rank']; the keys are "
        "['r', 'alpha', 'dropout', 'target_modules', 'towers', 'trainable']")
    assert _refused({"r": 0}) == "model.lora.r must be >= 1, got 0"
    for dropout in (1.0, -0.1):
        assert _refused({"dropout": dropout}) == f"model.lora.dropout must be in [0, 1), got {dropout}"
    assert _refused({"towers": ["text", "audio", "depth"]}) == (
        "model.lora.towers: ['audio', 'depth'] are not towers of this model; choose from ['image', 'text']")


def test_an_open_clip_model_with_a_timm_trunk_and_its_own_text_tower_is_adapted_in_both():
    model = CustomTextCLIP(
        embed_dim=16,
        vision_cfg={"timm_model_name": "vit_tiny_patch16_224", "timm_model_pretrained": False, "image_size": 32,
                    "timm_pool": "", "timm_proj": "linear"},
        text_cfg={"context_length": 8, "vocab_size": 100, "width": 16, "heads": 2, "layers": 1},
    )
    towers = clip_towers(model)
    assert towers == {"image": Tower("visual.trunk.", ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")),
                      "text": Tower("text.", ("attn", "c_fc", "c_proj"))}
    targets = resolve_targets(model, LoraSpec(), towers)
    assert {t for t in targets if t.startswith("visual.trunk.blocks.0.")} == {
        f"visual.trunk.blocks.0.{m}" for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert {t for t in targets if t.startswith("text.")} == {
        "text.transformer.resblocks.0.attn", "text.transformer.resblocks.0.mlp.c_fc",
        "text.transformer.resblocks.0.mlp.c_proj"}
    assert len(targets) == 4 * 12 + 3


def test_the_towers_of_a_plain_open_clip_model(clip_base):
    model = CLIP(model_name=clip_base[0]).model
    assert clip_towers(model) == {"image": Tower("visual.", ("attn", "c_fc", "c_proj")),
                                  "text": Tower("transformer.", ("attn", "c_fc", "c_proj"))}


def test_globs_and_repeated_patterns_adapt_each_layer_once_and_a_missing_default_names_the_candidates(clip_base):
    model = CLIP(model_name=clip_base[0]).model
    towers = clip_towers(model)
    spec = LoraSpec(target_modules=("*.mlp.c_fc", "c_fc", "visual.transformer.resblocks.0.mlp.c_proj"))
    assert resolve_targets(model, spec, towers) == [
        "visual.transformer.resblocks.0.mlp.c_fc", "transformer.resblocks.0.mlp.c_fc",
        "visual.transformer.resblocks.0.mlp.c_proj"]
    with pytest.raises(ValueError) as info:
        resolve_targets(model, LoraSpec(towers=("image",)), {"image": Tower("visual.", ("qkv",))})
    # The image tower's layers only, by their last two name parts with the block numbers dropped.
    assert str(info.value) == ("model.lora: the default target 'qkv' matches no layer under 'visual.'; set "
                               "model.lora.target_modules, candidates: ['attn', 'mlp.c_fc', 'mlp.c_proj']")


def test_trainable_globs_replace_the_defaults_and_dropout_reaches_every_adapter(clip_base):
    model = CLIP(model_name=clip_base[0]).model
    spec = LoraSpec(r=2, alpha=6.0, dropout=0.25, target_modules=("c_fc",), towers=("text",),
                    trainable=("ln_final.*",))
    inject_lora(model.requires_grad_(False), spec, clip_towers(model), CLIP_TRAINABLE)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"ln_final.weight", "ln_final.bias",
                         "transformer.resblocks.0.mlp.c_fc.lora_A.default.weight",
                         "transformer.resblocks.0.mlp.c_fc.lora_B.default.weight"}  # not logit_scale
    layer = model.get_submodule("transformer.resblocks.0.mlp.c_fc")
    assert isinstance(layer.lora_dropout["default"], nn.Dropout) and layer.lora_dropout["default"].p == 0.25
    assert layer.scaling["default"] == 3.0  # alpha / r
    assert has_lora(model) and not has_lora(CLIP(model_name=clip_base[0]).model)


@pytest.mark.parametrize("layer", ["visual.transformer.resblocks.0.mlp.c_fc", "visual.transformer.resblocks.0.attn"])
def test_a_merge_refuses_an_adapter_that_would_write_nan(clip_base, layer):
    model = CLIP(model_name=clip_base[0]).model
    inject_lora(model, LoraSpec(r=2), clip_towers(model), CLIP_TRAINABLE)
    with torch.no_grad():
        model.get_submodule(layer).lora_B["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaNs detected in the merged weights"):
        merge_lora(model)


def test_base_files_are_recorded_by_absolute_path_and_sha256_and_checked(tmp_path, monkeypatch):
    big = tmp_path / "base.pth"
    big.write_bytes(os.urandom((1 << 20) + 5))  # more than one read block
    assert sha256_file(str(big)) == hashlib.sha256(big.read_bytes()).hexdigest()
    monkeypatch.chdir(tmp_path)
    reference = base_reference({"pretrained": "base.pth", "init_encoder": None, "image_tower_init": ""})
    assert reference == {"pretrained": {"path": str(big), "sha256": sha256_file(str(big))}}
    assert check_base(reference, "run.ckpt") == {"pretrained": str(big)}
    recorded = "f" * 64
    with pytest.raises(ValueError) as info:
        check_base({"pretrained": {"path": str(big), "sha256": recorded}}, "run.ckpt")
    assert str(info.value) == (f"run.ckpt: the LoRA base file {big} (model.pretrained) has changed since training "
                               f"(sha256 {sha256_file(str(big))[:12]}..., recorded ffffffffffff...)")
    with pytest.raises(FileNotFoundError) as info:
        check_base({"init_encoder": {"path": str(tmp_path / "gone.pth"), "sha256": recorded}}, "run.ckpt")
    assert str(info.value) == (f"run.ckpt: the LoRA base file {tmp_path / 'gone.pth'} (model.init_encoder) is "
                               "missing; the checkpoint holds only the adapters and needs the file it was trained on")


def _lora_clip(clip_base) -> CLIP:
    json_path, base = clip_base
    return CLIP(model_name=json_path, pretrained=str(base), lora={"r": 2, "target_modules": ["c_fc"]})


def test_trained_tensors_load_only_into_the_model_they_fit(clip_base):
    module = _lora_clip(clip_base)
    trained = {n: p.detach() + 1 for n, p in module.named_parameters() if p.requires_grad}
    assert len(trained) == 5  # 2 x (A, B) and logit_scale
    load_trained_state(module, trained, "a.ckpt")
    assert torch.equal(module.model.logit_scale, trained["model.logit_scale"])
    first = sorted(trained)[:4]
    with pytest.raises(KeyError) as info:
        load_trained_state(module, {k: v for k, v in trained.items() if k not in first}, "a.ckpt")
    assert info.value.args[0] == ("a.ckpt: the LoRA checkpoint does not fit the model its hyper-parameters build: "
                                  f"missing {first[:3]}, unexpected []")
    extra = {f"model.extra_{i}": torch.zeros(1) for i in range(4)}
    with pytest.raises(KeyError) as info:
        load_trained_state(module, {**trained, **extra}, "a.ckpt")
    assert info.value.args[0].endswith(f"missing [], unexpected {sorted(extra)[:3]}")


def test_a_resume_checks_the_base_and_every_trained_tensor(clip_base):
    module = _lora_clip(clip_base)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": {}}
    module.on_save_checkpoint(checkpoint)
    assert set(checkpoint["state_dict"]) == {n for n, p in module.named_parameters() if p.requires_grad}
    assert checkpoint[LORA_BASE] == module.lora_base
    module.on_load_checkpoint(checkpoint)  # the same base, every tensor: accepted
    moved = {**checkpoint, LORA_BASE: {"pretrained": {**module.lora_base["pretrained"], "path": "/elsewhere"}}}
    module.on_load_checkpoint(moved)  # the same file content elsewhere: accepted
    for base in (None, {}, {"pretrained": {"path": "x"}}):
        with pytest.raises(ValueError, match=re.escape(f"the checkpoint was trained on {base or {}}, this run's")):
            module.on_load_checkpoint({**checkpoint, LORA_BASE: base})
    names = sorted(checkpoint["state_dict"])[:4]
    lacking = {**checkpoint, "state_dict": {k: v for k, v in checkpoint["state_dict"].items() if k not in names}}
    with pytest.raises(KeyError) as info:
        module.on_load_checkpoint(lacking)
    assert info.value.args[0] == f"the LoRA checkpoint lacks trainable tensors {names[:3]}"
    assert module.sharding_refusal() == (
        "model.init_args.lora: LoRA adapters are not sharded by FSDP2 in mmssl; train LoRA with DDP "
        "(configs/trainer/ddp.yaml, ddp_cpu.yaml)")
    assert CLIP(model_name=clip_base[0]).sharding_refusal() is None


def test_lora_without_a_pretrained_file_or_without_peft_is_refused_saying_what_is_needed(clip_base, monkeypatch):
    with pytest.raises(ValueError) as info:
        CLIP(model_name=clip_base[0], lora={"r": 2})
    assert str(info.value) == ("model.lora needs model.pretrained: a LoRA checkpoint holds only the adapters and "
                               "names the pretrained file it adapts")
    assert _lora_clip(clip_base).strict_loading is False  # a resume loads the trained tensors only
    model = CLIP(model_name=clip_base[0]).model
    for name in [n for n in sys.modules if n == "peft" or n.startswith("peft.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as with peft uninstalled
    with pytest.raises(ImportError) as info:
        inject_lora(model, LoraSpec(), clip_towers(model), CLIP_TRAINABLE)
    assert str(info.value) == "model.lora needs Hugging Face peft: pip install -e '.[lora]'"
