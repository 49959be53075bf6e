import math

import torch
import torch.nn.functional as F

from mmssl.losses import clip_loss, mae_loss


def _reference_clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: float) -> float:
    """Loop-by-loop InfoNCE, written independently of the vectorised version."""
    n = img.shape[0]
    total = 0.0
    for i in range(n):
        logits_i2t = [scale * float(img[i] @ txt[j]) for j in range(n)]
        logits_t2i = [scale * float(txt[i] @ img[j]) for j in range(n)]
        for logits in (logits_i2t, logits_t2i):
            total += -(logits[i] - math.log(sum(math.exp(v) for v in logits)))
    return total / (2 * n)


def test_clip_loss_matches_hand_written_reference():
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(6, 8, generator=g), dim=-1)
    txt = F.normalize(torch.randn(6, 8, generator=g), dim=-1)
    loss = clip_loss(img, txt, torch.tensor(14.3))
    assert abs(loss.item() - _reference_clip_loss(img, txt, 14.3)) < 1e-4


def test_clip_loss_is_low_for_matching_pairs_and_high_for_shuffled():
    img = F.normalize(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)), dim=-1)
    matched = clip_loss(img, img, torch.tensor(100.0))
    shuffled = clip_loss(img, img.roll(1, dims=0), torch.tensor(100.0))
    assert matched.item() < 0.01 < shuffled.item()


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
