"""Attention rollout and maps, patch-text similarity, and the scaling-law fit, as pure functions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE
from mmssl.visualize.attention import (
    attention_maps,
    attention_rollout,
    attention_weights,
    cls_patch_map,
    record_attention,
    vision_tower,
)
from mmssl.visualize.scaling import fit_power_law, pool_points, power_law, read_run
from mmssl.visualize.similarity import patch_embeddings, self_attention_only, similarity_maps


def _row_stochastic(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(*shape, generator=generator).softmax(dim=-1)


def test_rollout_equals_the_hand_product_on_two_layers():
    g = torch.Generator().manual_seed(0)
    tokens = 1 + 2 * 3  # cls + a 2x3 patch grid
    a1 = _row_stochastic(2, 4, tokens, tokens, generator=g)  # (B, heads, T, T)
    a2 = _row_stochastic(2, 4, tokens, tokens, generator=g)
    eye = torch.eye(tokens)
    # Abnar & Zuidema: per layer 0.5 * mean-over-heads + 0.5 * I, later layers on the left.
    by_hand = (0.5 * a2.mean(1) + 0.5 * eye) @ (0.5 * a1.mean(1) + 0.5 * eye)
    rollout = attention_rollout([a1, a2])
    torch.testing.assert_close(rollout, by_hand)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, tokens))  # rows stay distributions
    grid = cls_patch_map(rollout, 1, (2, 3))
    assert grid.shape == (2, 2, 3)
    torch.testing.assert_close(grid.sum((-2, -1)), torch.ones(2))
    # The map is the cls row's patch columns in row-major order, renormalised.
    torch.testing.assert_close(grid[1, 1, 0], by_hand[1, 0, 4] / by_hand[1, 0, 1:].sum())
    heads = cls_patch_map(a2, 1, (2, 3))
    assert heads.shape == (2, 4, 2, 3)
    torch.testing.assert_close(heads.sum((-2, -1)), torch.ones(2, 4))
    with pytest.raises(ValueError, match="patch grid"):
        cls_patch_map(a2, 1, (3, 3))


def test_max_fusion_renormalises_rows():
    g = torch.Generator().manual_seed(1)
    a = _row_stochastic(1, 3, 5, 5, generator=g)
    torch.testing.assert_close(attention_rollout([a, a], "max").sum(-1), torch.ones(1, 5))


def _tiny_mae() -> MAE:
    torch.manual_seed(0)
    return MAE(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32,
               decoder_depth=1, decoder_num_heads=2).eval()


def test_recorded_attention_is_the_blocks_softmax_and_changes_nothing():
    """The hooked weights equal softmax(q k^T / sqrt(d)) of block 1, recomputed from its own
    qkv projection; the encoder's output is the same with and without recording."""
    mae = _tiny_mae()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = mae.forward_features(images)
        tower = vision_tower(mae)
        with record_attention(tower.module) as weights:
            during = tower.forward(images)
        x = mae.encoder.prepend_cls(mae.encoder.embed_patches(images))  # (B, 17, 32)
        block = mae.encoder.blocks[0]
        qkv = block.attn.qkv(block.norm1(x)).reshape(2, 17, 3, 2, 16).permute(2, 0, 3, 1, 4)
        by_hand = (qkv[0] @ qkv[1].transpose(-2, -1) / 16**0.5).softmax(-1)  # (B, heads, T, T)
    assert len(weights) == 2 and weights[0].shape == (2, 2, 17, 17)
    torch.testing.assert_close(weights[0], by_hand, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(during, before, rtol=1e-4, atol=1e-5)
    assert all(b.attn.fused_attn for b in mae.encoder.blocks)  # switched back on


def test_clip_attention_maps_through_multihead_attention(tiny_clip_json):
    torch.manual_seed(0)
    clip = CLIP(tiny_clip_json).eval()
    images = torch.randn(3, 3, 32, 32)
    maps = attention_maps(clip, images)
    assert maps["heads"].shape == (3, 2, 4, 4) and maps["rollout"].shape == (3, 4, 4)
    torch.testing.assert_close(maps["rollout"].sum((-2, -1)), torch.ones(3))
    with torch.no_grad():
        before = clip.encode_image(images)
        with record_attention(vision_tower(clip).module) as weights:
            during = clip.encode_image(images)  # open_clip's own blocks, asked for their weights
    torch.testing.assert_close(during, before, rtol=1e-4, atol=1e-5)
    assert len(weights) == 1 and weights[0].shape == (3, 2, 17, 17)
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(3, 2, 17))
    assert len(attention_weights(vision_tower(clip), images)) == 1  # hooks removed: no stale weights


def test_similarity_peaks_at_the_patch_the_text_matches(tiny_clip_json, monkeypatch):
    torch.manual_seed(0)
    clip = CLIP(tiny_clip_json).eval()
    images = torch.randn(1, 3, 32, 32)
    tokens = patch_embeddings(clip, images)  # (1, 1+16, D)
    # The cls token through the same norm and projection is open_clip's image embedding.
    torch.testing.assert_close(tokens[:, 0], clip.encode_image(images, normalize=False), rtol=1e-4, atol=1e-5)
    target = 11  # row 2, column 3 of the 4x4 grid
    text = 3.0 * tokens[0, 1 + target]  # a text tower whose every caption lands on that patch (scaled)
    monkeypatch.setattr(clip, "encode_text", lambda ids, normalize=True: text.expand(len(ids), -1))

    maps = similarity_maps(clip, images, ["a red star", "a blue circle"])
    assert maps.shape == (1, 2, 4, 4)
    for q in range(2):
        assert int(maps[0, q].argmax()) == target and divmod(target, 4) == (2, 3)
        assert maps[0, q, 2, 3] == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(TypeError, match="not a CLIP"):
        similarity_maps(_tiny_mae(), images, ["x"])


def test_value_path_makes_the_last_block_attend_to_itself(tiny_clip_json):
    """MaskCLIP's value path: the last block's attention is the identity, each token's attention
    output then out_proj(v_i); the hook is gone afterwards."""
    torch.manual_seed(0)
    clip = CLIP(tiny_clip_json).eval()
    images = torch.randn(2, 3, 32, 32)
    visual = clip.model.visual
    with torch.no_grad(), self_attention_only(visual), record_attention(visual) as weights:
        clip.forward_features(images)
    torch.testing.assert_close(weights[-1], torch.eye(17).expand(2, 2, 17, 17))
    plain, value = patch_embeddings(clip, images), patch_embeddings(clip, images, value_path=True)
    assert plain.shape == value.shape and not torch.allclose(plain, value)
    torch.testing.assert_close(patch_embeddings(clip, images), plain)  # nothing left behind


def test_scaling_fit_recovers_a_noisy_power_law():
    rng = np.random.default_rng(0)
    a, b, c = 40.0, 0.12, 1.3
    compute = np.logspace(12, 17, 12)
    noise = 0.004
    loss = power_law(compute, a, b, c) + rng.normal(0, noise, compute.shape)
    fit = fit_power_law(compute, loss, np.full(compute.shape, noise))
    err = fit.stderr
    assert fit.b == pytest.approx(b, abs=4 * err["b"]) and err["b"] < 0.03
    assert fit.c == pytest.approx(c, abs=4 * err["c"]) and err["c"] < 0.1
    assert np.log(fit.a) == pytest.approx(np.log(a), abs=4 * err["log_a"])
    target = float(power_law(1e15, a, b, c))
    assert fit.compute_for(target) == pytest.approx(1e15, rel=0.3)
    with pytest.raises(ValueError, match="irreducible"):
        fit.compute_for(fit.c - 0.1)


def test_pooled_seeds_give_mean_and_spread():
    compute, mean, std, count = pool_points([(2e12, 1.0), (1e12, 3.0), (2e12, 2.0), (1e12, 5.0), (4e12, 0.5)])
    np.testing.assert_allclose(compute, [1e12, 2e12, 4e12])
    np.testing.assert_allclose(mean, [4.0, 1.5, 0.5])
    np.testing.assert_allclose(std[:2], [np.sqrt(2), np.sqrt(0.5)])
    assert np.isnan(std[2]) and list(count) == [2, 2, 1]


def test_read_run_names_what_is_missing(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch,step,train/loss,val/loss\n0,9,2.0,\n0,9,,1.5\n1,19,,1.2\n")
    with pytest.raises(FileNotFoundError, match="compute.json"):
        read_run(str(run))
    (run / "compute.json").write_text(json.dumps({"flops_per_step": 1e9}))
    curve = read_run(str(tmp_path))  # the folder holding one version_N
    np.testing.assert_allclose(curve.compute, [10e9, 20e9])  # step 9 is the 10th step
    assert curve.pick("final") == (20e9, 1.2) and curve.pick("best") == (20e9, 1.2)
    with pytest.raises(KeyError, match="val/zero"):
        read_run(str(run), "val/zero_shot_top1")
