import torch

from mmssl.losses import mae_loss


def reference_mae_loss(target, pred, mask, norm_pix_loss):
    """Plain loops over samples and patches, as written in MAE's forward_loss."""
    total, count = 0.0, 0.0
    for b in range(target.shape[0]):
        for i in range(target.shape[1]):
            if mask[b, i] == 0:
                continue
            t = target[b, i]
            if norm_pix_loss:
                t = (t - t.mean()) / (t.var() + 1e-6).sqrt()
            total += ((pred[b, i] - t) ** 2).mean()
            count += 1
    return total / count


def test_matches_reference():
    g = torch.Generator().manual_seed(0)
    target, pred = torch.randn(3, 10, 12, generator=g), torch.randn(3, 10, 12, generator=g)
    mask = (torch.rand(3, 10, generator=g) > 0.4).float()
    for norm in (True, False):
        torch.testing.assert_close(mae_loss(target, pred, mask, norm), reference_mae_loss(target, pred, mask, norm))


def test_ignores_visible_patches():
    target, pred = torch.randn(2, 8, 6), torch.randn(2, 8, 6)
    mask = torch.zeros(2, 8)
    mask[:, ::2] = 1
    changed = pred.clone()
    changed[mask == 0] += 100.0
    assert torch.equal(mae_loss(target, pred, mask), mae_loss(target, changed, mask))
    perfect = target.clone()
    assert mae_loss(target, perfect, mask, norm_pix_loss=False) == 0
