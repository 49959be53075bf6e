"""LoRA checkpoints across peft versions (mmssl.models.lora.match_installed_peft): peft before 0.22
applied a MultiheadAttention's out_proj update twice (W + 2 dW), 0.22 once (huggingface/peft PR
#3774). A checkpoint records its peft and every load scales out_proj's lora_B so the model
computes what it trained as, under whichever peft is installed (CI takes the newest)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

peft = pytest.importorskip("peft")

from mmssl.checkpoints.load import load_lightning  # noqa: E402
from mmssl.models.clip import CLIP  # noqa: E402
from mmssl.models.lora import (  # noqa: E402
    LORA_PEFT,
    installed_peft,
    match_installed_peft,
    mha_out_proj_lora_b,
    out_proj_applications,
)

DIM, HEADS, R, ALPHA = 8, 2, 2, 4.0


class _Block(nn.Module):
    """An attention layer with a Linear beside it (adapted too, its lora_B never rescaled)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


def _adapted(seed: int = 0) -> nn.Module:
    """The same base every time, adapters drawn from ``seed``."""
    torch.manual_seed(0)
    model = _Block()
    peft.inject_adapter_in_model(peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["attn", "fc"]), model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _by_hand(model: nn.Module, x: torch.Tensor, out_proj_times: int) -> torch.Tensor:
    """What the adapted block computes when out_proj's update counts ``out_proj_times`` times:
    plain attention with W_in + dW_in and W_out + times x dW_out, then fc's W + dW."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    scale = ALPHA / R
    mha = "attn.base_layer."
    d_in = scale * state["attn.lora_B.default.weight"] @ state["attn.lora_A.default.weight"]
    w_in = state[mha + "in_proj_weight"] + d_in
    d_out = scale * state[mha + "out_proj.lora_B.default.weight"] @ state[mha + "out_proj.lora_A.default.weight"]
    w_out = state[mha + "out_proj.base_layer.weight"] + out_proj_times * d_out
    attn, _ = F.multi_head_attention_forward(
        x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), DIM, HEADS, w_in, state[mha + "in_proj_bias"],
        None, None, False, 0.0, w_out, state[mha + "out_proj.base_layer.bias"], training=False, need_weights=False)
    w_fc = state["fc.base_layer.weight"] + scale * state["fc.lora_B.default.weight"] @ state["fc.lora_A.default.weight"]
    return F.linear(attn.transpose(0, 1), w_fc, state["fc.base_layer.bias"])


def test_the_installed_peft_applies_out_proj_update_as_many_times_as_its_version_says():
    """The premise of the conversion, checked on the installed peft: it fails if peft changes again."""
    model, x = _adapted(), torch.randn(3, 5, DIM)
    times = out_proj_applications(installed_peft())
    with torch.no_grad():
        torch.testing.assert_close(model(x), _by_hand(model, x, times), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(_by_hand(model, x, 1), _by_hand(model, x, 2), atol=1e-3)  # the two differ


@pytest.mark.parametrize("recorded, times", [("0.21.2", 2), ("0.17.0", 2), ("0.22.0", 1), ("0.23.1", 1), (None, 2)])
def test_a_checkpoint_of_any_peft_loads_to_what_it_trained_as(recorded, times):
    trained = _adapted()
    x = torch.randn(3, 5, DIM)
    with torch.no_grad():
        expected = _by_hand(trained, x, times)  # what its recorded peft computed
    checkpoint = {"lora_base": {"pretrained": {"path": "base.pth", "sha256": "0"}},
                  "state_dict": {k: v.clone() for k, v in trained.state_dict().items() if "lora_" in k}}
    if recorded:
        checkpoint[LORA_PEFT] = recorded
    fresh = _adapted(seed=5)  # other adapters: the checkpoint's must replace them
    match_installed_peft(fresh, checkpoint, "run.ckpt")
    fresh.load_state_dict(checkpoint["state_dict"], strict=False)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), expected, rtol=1e-5, atol=1e-6)
    assert checkpoint[LORA_PEFT] == installed_peft()


def test_only_out_proj_lora_b_is_scaled_in_every_weight_entry_once_with_one_warning():
    model = _adapted()
    assert mha_out_proj_lora_b(model) == ["attn.base_layer.out_proj.lora_B.default.weight"]
    weights = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    checkpoint = {"lora_base": {"x": {}}, LORA_PEFT: "0.21.2", "state_dict": dict(weights),
                  "averaged_state_dict": dict(weights), "current_model_state": dict(weights), "epoch": 3}
    with pytest.warns(UserWarning, match=re.escape("run.ckpt: LoRA adapters trained under peft 0.21.2") + ".*"
                      + re.escape("out_proj's lora_B scaled by 2 ")):
        match_installed_peft(model, checkpoint, "run.ckpt", installed="0.22.0")
    name = "attn.base_layer.out_proj.lora_B.default.weight"
    for entry in ("state_dict", "averaged_state_dict", "current_model_state"):
        for key, value in checkpoint[entry].items():
            torch.testing.assert_close(value, weights[key] * (2 if key == name else 1), rtol=0, atol=0)
    assert checkpoint[LORA_PEFT] == "0.22.0"
    before = {k: v.clone() for k, v in checkpoint["state_dict"].items()}
    match_installed_peft(model, checkpoint, "run.ckpt", installed="0.22.0")  # converted already: unchanged
    assert all(torch.equal(before[k], checkpoint["state_dict"][k]) for k in before)
    # The other way: a 0.22 checkpoint under an older peft halves it.
    back = {"lora_base": {"x": {}}, LORA_PEFT: "0.22.0", "state_dict": dict(weights)}
    with pytest.warns(UserWarning, match="scaled by 0.5 "):
        match_installed_peft(model, back, "new.ckpt", installed="0.21.2")
    torch.testing.assert_close(back["state_dict"][name], weights[name] / 2, rtol=0, atol=0)
    plain = {"state_dict": dict(weights)}  # not a LoRA checkpoint: untouched, nothing recorded
    match_installed_peft(model, plain, "plain.ckpt", installed="0.22.0")
    assert LORA_PEFT not in plain and torch.equal(plain["state_dict"][name], weights[name])


def test_a_lora_checkpoint_records_its_peft_and_loads_as_trained_when_it_came_from_another(tiny_clip_json, tmp_path):
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), tmp_path / "base.pth")
    module = CLIP(model_name=tiny_clip_json, pretrained=str(tmp_path / "base.pth"), lora={"r": 4}).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint[LORA_PEFT] == peft.__version__
    images, tokens = torch.randn(2, 3, 32, 32), module.tokenizer(["a red square", "a blue circle"])
    with torch.no_grad():
        trained = module(images, tokens)["image_features"]
    # The same adapters, as the other peft would have written them: out_proj's update rescaled.
    other = "0.21.2" if out_proj_applications(peft.__version__) == 1 else "0.22.0"
    factor = out_proj_applications(peft.__version__) / out_proj_applications(other)
    names = mha_out_proj_lora_b(module)
    assert len(names) == 2  # the image and the text tower's attention
    checkpoint["state_dict"] = {k: v * factor if k in names else v for k, v in checkpoint["state_dict"].items()}
    checkpoint[LORA_PEFT] = other
    torch.save(checkpoint, tmp_path / "other.ckpt")
    with pytest.warns(UserWarning, match=f"trained under peft {other}"):
        loaded = load_lightning(str(tmp_path / "other.ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(images, tokens)["image_features"], trained, rtol=1e-5, atol=1e-6)
    # A resume reads it through the module's hook, before Lightning loads the weights.
    resumed = CLIP(model_name=tiny_clip_json, pretrained=str(tmp_path / "base.pth"), lora={"r": 4}).eval()
    saved = torch.load(tmp_path / "other.ckpt", weights_only=True)
    with pytest.warns(UserWarning, match="the resumed checkpoint"):
        resumed.on_load_checkpoint(saved)
    resumed.load_state_dict(saved["state_dict"], strict=False)
    with torch.no_grad():
        torch.testing.assert_close(resumed(images, tokens)["image_features"], trained, rtol=1e-5, atol=1e-6)
