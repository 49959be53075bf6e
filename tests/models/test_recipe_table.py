"""Each recipe's resolved optimizer against a table written from its sources (issue 14).

The table below is written from the papers and the authors' files, not from the YAML:
CLIP Tables 18/20 + open_clip_train/main.py; FLIP configs/default.py, t5x/train_state_initializer.py,
utils/opt_util.py, README "Unmasked tuning"; SigLIP paper + big_vision optax.py / siglip_lit_coco.py;
MAE main_pretrain.py (timm 0.3.2 add_weight_decay). Towers are built on the meta device (shapes
and names only), so ViT-B costs nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import open_clip
import pytest
import torch
import yaml
from torch import nn

from mmssl.models.clip import OPEN_CLIP_NO_DECAY, resolve_model_name
from mmssl.models.mae import MAE
from mmssl.optim import Phase, param_groups, record_shapes, warmup_cosine

REPO = Path(__file__).resolve().parents[2]


def open_clip_rule(n: str, p: nn.Parameter) -> bool:  # open_clip_train/main.py, verbatim
    return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n


def flip_rule(n: str, p: nn.Parameter) -> bool:
    # utils/opt_util.py: filter_bias_and_norm (path[-1] in {bias, scale}) and filter_posembed, in
    # open_clip's names: biases, LayerNorm gains (ln_*.weight), position embeddings.
    leaf = n.rsplit(".", 1)[-1]
    return leaf.endswith("bias") or (".ln_" in n and leaf == "weight") or "positional_embedding" in n


def big_vision_rule(n: str, p: nn.Parameter) -> bool:
    # big_vision/optax.py: only ".*/kernel$" (Dense / Conv weights) decayed. Non-kernels in the
    # open_clip/timm names: norms and biases (1-D), embeddings, the MAP probe, t and b (0-D).
    return p.ndim < 2 or n.endswith(("pos_embed", "positional_embedding", "token_embedding.weight", "attn_pool.latent"))


def mae_rule(n: str, p: nn.Parameter) -> bool:  # timm 0.3.2 add_weight_decay, empty skip list
    return p.ndim == 1 or n.endswith(".bias")


# recipe: global batch, lr, betas, eps, weight decay, warm-up, steps, rule
SOURCES = {
    "clip/vit_b32": (32768, 5e-4, (0.9, 0.98), 1e-6, 0.2, 2000, 390625, open_clip_rule),
    "clip/vit_b16": (32768, 5e-4, (0.9, 0.98), 1e-6, 0.2, 2000, 390625, open_clip_rule),
    # FLIP: 65536 batch, 4e-6 x 65536/256, 10000 x (1281167 // 65536) masked + 100 x 19 tuning steps.
    "clip/flip_vit_b16": (65536, 4e-6 * 65536 / 256, (0.9, 0.95), 1e-8, 0.2, 40 * 19, 10000 * 19 + 100 * 19, flip_rule),
    # SigLIP: decoupled wd 1e-4 as torch AdamW's lr-coupled 1e-4 / 1e-3; warm-up 3% (siglip_lit_coco.py).
    "clip/siglip_vit_b16": (32768, 1e-3, (0.9, 0.95), 1e-8, 1e-4 / 1e-3, int(0.03 * 274658), 274658, big_vision_rule),
}


class _Holder(nn.Module):
    """Names parameters as the LightningModule does (``model.visual...``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _recipe(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())


def _global_batch(cfg: dict) -> int:
    t = cfg["trainer"]
    return cfg["data"]["init_args"]["batch_size"] * t["devices"] * t["num_nodes"] * t.get("accumulate_grad_batches", 1)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_clip_recipe_optimizer_matches_its_sources(name):
    batch, lr, betas, eps, wd, warmup, steps, rule = SOURCES[name]
    cfg = _recipe(name)
    model_args = cfg["model"]["init_args"]
    opt = model_args["optimizer"]["init_args"]
    assert _global_batch(cfg) == batch
    assert opt["lr"] == pytest.approx(lr) and tuple(opt["betas"]) == betas and opt["eps"] == eps
    assert opt["weight_decay"] == pytest.approx(wd)
    assert model_args["warmup_steps"] == warmup and cfg["trainer"]["max_steps"] == steps
    with torch.device("meta"):
        holder = _Holder(open_clip.create_model(resolve_model_name(str(REPO / model_args["model_name"])
                                                                   if model_args["model_name"].endswith(".json")
                                                                   else model_args["model_name"]), device="meta"))
    patterns = model_args.get("no_weight_decay", OPEN_CLIP_NO_DECAY)
    groups = param_groups(holder, patterns, record_shapes(holder), weight_decay=opt["weight_decay"])
    names = {id(p): n for n, p in holder.named_parameters()}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    expected = {n for n, p in holder.named_parameters() if rule(n, p)}
    assert no_decay == expected, (
        f"{name}: extra {sorted(no_decay - expected)[:5]}, missing {sorted(expected - no_decay)[:5]}"
    )
    assert groups[1]["weight_decay"] == 0.0 and groups[0]["weight_decay"] == pytest.approx(wd)


def test_flip_recipe_data_and_masking_follow_the_source():
    cfg = _recipe("clip/flip_vit_b16")
    data, model = cfg["data"]["init_args"], cfg["model"]["init_args"]
    assert data["crop_scale"] == [0.5, 1.0] and data["hflip"] is True  # aug.area_range, aug.flip
    assert model["flip"]["mask_ratio"] == 0.5
    # README "Unmasked tuning": 100 virtual epochs x 19 steps, 20 warm-up epochs, base lr 4e-8 vs 4e-6.
    assert (model["flip"]["unmasked_tune_steps"], model["flip"]["unmasked_tune_warmup_steps"]) == (1900, 380)
    assert model["flip"]["unmasked_tune_lr_ratio"] == pytest.approx(4e-8 / 4e-6)


def test_flip_lr_over_the_whole_run():
    """Masked phase: 760 warm-up steps then cosine to 0 at step 190000; tuning: 380 warm-up steps
    to 1% of the peak, then its own cosine to 0 at step 191900 (FLIP README + train_state_initializer)."""
    peak = 1.024e-3
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=peak)
    sched = warmup_cosine(opt, 760, 191900, second_phase=Phase(1900, 380, 0.01))
    lr = lambda step: peak * sched.lr_lambdas[0](step)  # noqa: E731  (LambdaLR's factor at a step)
    masked_cos = lambda s: 0.5 * (1 + math.cos(math.pi * (s - 760) / (190000 - 760)))  # noqa: E731
    assert lr(0) == pytest.approx(peak / 760) and lr(759) == pytest.approx(peak)
    assert lr(95380) == pytest.approx(peak * masked_cos(95380))
    assert lr(189999) < 1e-9 * peak * 1e3
    tune_peak = 0.01 * peak
    assert lr(190000) == pytest.approx(tune_peak / 380) and lr(190379) == pytest.approx(tune_peak)
    assert lr(190380 + 760) == pytest.approx(tune_peak * 0.5 * (1 + math.cos(math.pi * 760 / 1520)))
    assert lr(191899) < tune_peak * 1e-5


def test_mae_recipes_decay_as_the_official_pretraining():
    cfg = _recipe("mae/vit_base_patch16")["model"]["init_args"]
    with torch.device("meta"):
        mae = MAE(**{k: v for k, v in cfg.items() if k != "optimizer"})
    groups = param_groups(mae, mae.no_weight_decay, mae._param_ndim)
    names = {id(p): n for n, p in mae.named_parameters()}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    trainable = {n: p for n, p in mae.named_parameters() if p.requires_grad}
    assert no_decay == {n for n, p in trainable.items() if mae_rule(n, p)}
    assert "encoder.cls_token" not in no_decay and "decoder.mask_token" not in no_decay
