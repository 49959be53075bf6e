"""MAE's masked-image reconstruction on CLIP's image tower (``objectives.masked_image``) in process:
the term against MAE written out by hand on a tiny tower, the tower seeing the visible patches only,
the mean over the global batch's masked patches on ranks of unequal batches, the 0 weight before
the start, and what is refused at start-up. Through the CLI on 2 gloo ranks: test_masked_image_cli.py."""

from __future__ import annotations

import json
import types

import pytest
import torch

from mmssl.errors import ConfigError
from mmssl.export.checkpoint import to_open_clip
from mmssl.losses import mae_loss
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAEDecoder
from mmssl.objectives import OBJECTIVES, MaskedImageModelling
from tests.conftest import TINY_CLIP
from tests.helpers import as_two_thread_ranks

DECODER = {"decoder_embed_dim": 16, "decoder_depth": 1, "decoder_num_heads": 2}


@pytest.fixture(scope="module")
def clip_mae(tiny_clip_json) -> CLIP:
    torch.manual_seed(0)
    return CLIP(model_name=tiny_clip_json, objectives={"masked_image": {"start": 5, **DECODER}})


def _attach(model: CLIP, step: int = 0, total: int = 10) -> None:
    model._trainer = types.SimpleNamespace(global_step=step, estimated_stepping_batches=total, callbacks=[],
                                           datamodule=None)


def _batch(n: int = 3, seed: int = 3) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"image": torch.randn(n, 3, 32, 32, generator=generator), "text": torch.randint(1, 99, (n, 16))}


def _step(model: CLIP, step: int, batch: dict):
    _attach(model, step)
    try:
        out, batch = model.step_forward(dict(batch), training=True)
        return model.objective_terms(out, batch), out, batch
    finally:
        model._trainer = None


def _by_hand(model: CLIP, images: torch.Tensor, noise: torch.Tensor, ratio: float) -> tuple[torch.Tensor, ...]:
    """MAE (facebookresearch/mae models_mae.py) on open_clip's image tower, written out: embed the
    patches, add the class token and the positions, keep the int(L x (1 - ratio)) patches of least
    noise, ln_pre, the blocks, ln_post on every token, the decoder; the loss on the masked patches."""
    visual, decoder = model.model.visual, model.objectives["masked_image"].decoder
    batch, patch = images.shape[0], visual.patch_size[0]
    x = visual.conv1(images).flatten(2).transpose(1, 2)  # (B, L, D), row-major patches
    cls = visual.class_embedding.reshape(1, 1, -1).expand(batch, 1, -1)
    x = torch.cat([cls, x], dim=1) + visual.positional_embedding
    length = x.shape[1] - 1
    keep = int(length * (1 - ratio))
    order = noise.argsort(dim=1)
    visible = torch.stack([x[b, 1:][order[b, :keep]] for b in range(batch)])
    tokens = visual.ln_post(visual.transformer(visual.ln_pre(torch.cat([x[:, :1], visible], dim=1))))
    pred = decoder(tokens, order.argsort(dim=1))
    mask = torch.ones(batch, length)
    for b in range(batch):
        mask[b, order[b, :keep]] = 0
    # Patch (i, j) of image b, flattened as (p, p, C): MAE's patchify.
    grid = images.shape[-1] // patch
    target = torch.stack([torch.stack([images[b, :, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch]
                                       .permute(1, 2, 0).reshape(-1) for i in range(grid) for j in range(grid)])
                          for b in range(batch)])
    return pred, target, mask


def test_the_term_is_mae_on_the_image_tower_by_hand(clip_mae):
    terms, out, batch = _step(clip_mae, 7, _batch())
    pred, target, mask = _by_hand(clip_mae, batch["image"], batch["mae_noise"], 0.75)
    torch.testing.assert_close(out["mae_pred"], pred, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["mae_target"], target)
    assert torch.equal(out["mae_mask"], mask) and mask.sum().item() == 3 * 12  # 75% of 16 patches
    assert terms["masked_image"].item() == pytest.approx(mae_loss(target, pred, mask).item(), rel=1e-5)
    # Per-patch normalised targets (MAE's norm_pix_loss): a patch's brightness and contrast do not count.
    centred = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    by_hand = ((pred - centred) ** 2).mean(-1)[mask.bool()].mean()
    assert terms["masked_image"].item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_the_tower_sees_only_the_visible_patches(clip_mae):
    """Repainting a masked patch changes its target and nothing the model predicts; repainting a
    visible one changes the predictions."""
    clip_mae.eval()
    images = _batch(2)["image"]
    noise = torch.rand(2, 16, generator=torch.Generator().manual_seed(1))
    base = clip_mae.masked_reconstruction(images, noise)
    masked = int(base["mae_mask"][0].nonzero()[0])
    visible = int((base["mae_mask"][0] == 0).nonzero()[0])
    for index, seen in ((masked, False), (visible, True)):
        other = images.clone()
        row, col = divmod(index, 4)  # a 4 x 4 grid of 8-pixel patches
        other[0, :, 8 * row:8 * row + 8, 8 * col:8 * col + 8] = 5.0
        again = clip_mae.masked_reconstruction(other, noise)
        assert not torch.equal(again["mae_target"][0, index], base["mae_target"][0, index])
        assert torch.equal(again["mae_pred"][1], base["mae_pred"][1])  # the other image
        assert torch.equal(again["mae_pred"][0], base["mae_pred"][0]) != seen, (index, seen)
    clip_mae.train()


def test_ranks_of_unequal_batches_train_the_global_masked_patch_mean(monkeypatch):
    """Two ranks as two threads (all_reduce a sum through a barrier), 2 images on one and 1 on the
    other: the ranks' terms average, as DDP averages their gradients, to the mean over every masked
    patch of the 3 images, not to the mean of the ranks' means."""
    objective = MaskedImageModelling(norm_pix_loss=False, **DECODER)
    errors = [torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 9.0]]), torch.tensor([[10.0, 20.0, 30.0, 9.0]])]
    outs = [{"mae_pred": e.sqrt().unsqueeze(-1), "mae_target": torch.zeros(*e.shape, 1),
             "mae_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]).expand_as(e)} for e in errors]  # the 4th patch seen
    monkeypatch.setattr("mmssl.objectives.base.is_distributed", lambda: True)
    monkeypatch.setattr("mmssl.objectives.base.world_size", lambda: 2)
    terms = as_two_thread_ranks(monkeypatch, lambda r: objective(outs[r], {}, 0.5))
    assert (terms[0] + terms[1]).item() / 2 == pytest.approx(0.5 * 81.0 / 9)


def test_before_its_start_the_term_weighs_0_and_draws_and_runs_alike(clip_mae):
    assert list(OBJECTIVES)[-1] == "masked_image"  # its draws after every other objective's
    batch = _batch()
    before, _, batch_before = _step(clip_mae, 4, batch)  # start: step 5
    after, _, batch_after = _step(clip_mae, 5, batch)
    assert before["masked_image"].item() == 0.0 and after["masked_image"].item() > 0
    assert torch.equal(_step(clip_mae, 4, batch)[2]["mae_noise"], batch_before["mae_noise"])  # seeded by the step
    assert not torch.equal(batch_after["mae_noise"], batch_before["mae_noise"])
    clip_mae.zero_grad()
    sum(before.values()).backward()  # in the graph before the start: DDP sees every parameter
    decoder = [p for n, p in clip_mae.named_parameters()
               if n.startswith("objectives.masked_image.") and p.requires_grad]
    assert decoder and all(p.grad is not None and not p.grad.any() for p in decoder)
    clip_mae.zero_grad()


def test_the_decoder_is_maes_in_the_checkpoint_under_the_objective(clip_mae):
    decoder = clip_mae.objectives["masked_image"].decoder
    assert isinstance(decoder, MAEDecoder) and decoder.pred.out_features == 8 * 8 * 3
    keys = clip_mae.state_dict().keys()
    assert "objectives.masked_image.decoder.mask_token" in keys
    assert not any(k.startswith("objectives.") for k in CLIP(model_name=clip_mae.hparams.model_name).state_dict())


def test_refused_at_start_up(tiny_clip_json, tmp_path):
    def build(**options):
        return CLIP(model_name=tiny_clip_json, objectives={"masked_image": {**DECODER, **options}})

    for options, message in (({"mask_ratio": 0.0}, r"masked_image.mask_ratio: in \(0, 1\)"),
                             ({"mask_ratio": 1.0}, r"masked_image.mask_ratio: in \(0, 1\)"),
                             ({"decoder_depth": 0}, "masked_image.decoder_depth: an integer >= 1"),
                             ({"decoder_num_heads": 3}, "16 is not divisible by decoder_num_heads=3"),
                             ({"patches": 3}, "masked_image: .*unexpected keyword")):
        with pytest.raises(ConfigError, match=message):
            build(**options)
    wide = tmp_path / "wide.json"  # 4 x 6 patches: MAE's decoder has square 2-D sin-cos positions
    wide.write_text(json.dumps({**TINY_CLIP, "vision_cfg": {**TINY_CLIP["vision_cfg"], "image_size": [32, 48]}}))
    with pytest.raises(ConfigError, match=r"masked_image: needs square patches on a square grid, got .* 24 patches"):
        CLIP(model_name=str(wide), objectives={"masked_image": DECODER})
    with pytest.raises(ConfigError, match="masked_image: FLIP drops image patches .*flip.mask_ratio=0.5"):
        CLIP(model_name=tiny_clip_json, flip={"mask_ratio": 0.5}, objectives={"masked_image": DECODER})
    with pytest.raises(ConfigError, match=r"contrastive_chunk_size: the objective\(s\) \['masked_image'\]"):
        CLIP(model_name=tiny_clip_json, contrastive_chunk_size=2, objectives={"masked_image": DECODER})


def test_the_open_clip_export_leaves_the_decoder_out_and_embeds_alike(clip_mae, tiny_clip_json):
    clip_mae.eval()
    exported = to_open_clip(clip_mae.state_dict())
    assert not any("decoder" in k or k.startswith("objectives") for k in exported)
    model = CLIP(model_name=tiny_clip_json).model.eval()
    model.load_state_dict(exported)  # strict: every key of open_clip's model and nothing else
    images = _batch(2)["image"]
    with torch.no_grad():
        assert torch.equal(model.encode_image(images), clip_mae.model.encode_image(images))
    clip_mae.train()


def test_before_its_start_its_own_parameters_sit_out_the_optimizer(tiny_clip_json):
    """AdamW with weight decay, the term from step 2: for steps 0-1 the decoder keeps its initial
    weights bit for bit and has no optimizer state (no decay of weights its term does not use yet:
    SigLIP 2 initialises its heads and their optimizer state at the switch); from step 2 it trains,
    its state counting from there. The towers train from step 0."""
    torch.manual_seed(0)
    model = CLIP(model_name=tiny_clip_json, objectives={"masked_image": {"start": 2, **DECODER}})
    decoder = dict(model.objectives["masked_image"].decoder.named_parameters())
    initial = {n: p.detach().clone() for n, p in decoder.items()}
    tower = model.model.visual.conv1.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    for step in range(4):
        terms, _, _ = _step(model, step, _batch(seed=step))
        sum(terms.values()).backward()
        _attach(model, step)
        model.on_before_optimizer_step(optimizer)
        model._trainer = None
        optimizer.step()
        optimizer.zero_grad()
        trained = [n for n, p in decoder.items() if p.requires_grad and not torch.equal(p, initial[n])]
        if step < 2:
            assert not trained, (step, trained)
            assert not any(p in optimizer.state for p in decoder.values()), step
            assert optimizer.state[tower]["step"].item() == step + 1
        else:
            assert sorted(trained) == sorted(n for n, p in decoder.items() if p.requires_grad), step
            assert optimizer.state[decoder["embed.weight"]]["step"].item() == step - 1
