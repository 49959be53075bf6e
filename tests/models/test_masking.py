import pytest
import torch

from mmssl.models.masking import gather_tokens, num_kept, patchify, random_masking, unpatchify


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.75, 0.9])
def test_masking_invariants(ratio):
    x = torch.randn(5, 49, 8)
    ids_keep, ids_restore, mask = random_masking(x, ratio, torch.Generator().manual_seed(0))
    keep = num_kept(49, ratio)
    assert ids_keep.shape == (5, keep)
    assert ids_restore.shape == mask.shape == (5, 49)
    # Exactly L_keep visible patches per sample, and they are the ones in ids_keep.
    assert torch.equal((mask == 0).sum(1), torch.full((5,), keep))
    for b in range(5):
        assert set(ids_keep[b].tolist()) == set(torch.nonzero(mask[b] == 0).flatten().tolist())
        # ids_restore inverts the shuffle: it is a permutation and maps kept positions first.
        assert sorted(ids_restore[b].tolist()) == list(range(49))
        assert torch.equal(ids_restore[b][ids_keep[b]], torch.arange(keep))
    # Gathering the kept tokens then unshuffling with ids_restore puts each token back.
    kept = gather_tokens(x, ids_keep)
    filler = torch.zeros(5, 49 - keep, 8)
    restored = gather_tokens(torch.cat([kept, filler], 1), ids_restore)
    visible = (mask == 0).unsqueeze(-1)
    assert torch.equal(restored * visible, x * visible)


def test_masks_differ_per_sample():
    _, _, mask = random_masking(torch.zeros(8, 64, 1), 0.75)
    assert len({tuple(m.tolist()) for m in mask}) > 1


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match="mask_ratio"):
        random_masking(torch.zeros(2, 4, 1), ratio)


def test_patchify_roundtrip():
    imgs = torch.randn(2, 3, 16, 24)
    patches = patchify(imgs, 4)
    assert patches.shape == (2, 4 * 6, 4 * 4 * 3)
    # Patch 1 is the second patch of the top row, flattened as (p, q, C).
    assert torch.equal(patches[0, 1], imgs[0, :, :4, 4:8].permute(1, 2, 0).reshape(-1))
    assert torch.equal(unpatchify(patches, 4, (4, 6)), imgs)
    with pytest.raises(ValueError, match="patch_size"):
        patchify(imgs, 5)
