"""2 gloo CPU processes give exactly what one process gives on the concatenated batch.

For each loss, each rank runs its half of the batch through the CLIP module wrapped in torch's
DistributedDataParallel (what Lightning's DDP strategy wraps it in), so the gradients are
averaged over ranks as in training. The loss averaged over ranks and every parameter gradient
must equal one process's on the whole batch. Each rank's loss must also equal open_clip's own
distributed loss (``ClipLoss(local_loss=True, gather_with_grad=True)``, ``SigLipLoss``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.loss import ClipLoss, SigLipLoss
from torch.nn.parallel import DistributedDataParallel

from mmssl.distributed import gather_with_grad, rank, world_size
from mmssl.models.clip import CLIP
from mmssl.retrieval import distributed_retrieval_hits, retrieval_metrics
from tests.helpers import run_two_ranks

WORLD = 2
BATCH = 8  # global; 4 per rank
CAPTIONS = [f"a {c} {s}" for c in ("red", "blue") for s in ("circle", "square", "star", "cross")]


def _batch(model: CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, model.image_size, model.image_size, generator=g)
    return images, model.tokenizer(CAPTIONS)


def _model(json_path: str, loss: str) -> CLIP:
    torch.manual_seed(0)  # identical initial weights in every process
    return CLIP(json_path, loss=loss)


def _reference(json_path: str, loss: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = _model(json_path, loss)
    images, tokens = _batch(model)
    value = model.contrastive_loss(model(images, tokens))
    value.backward()
    return value.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _uneven_features() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    image = F.normalize(torch.randn(11, 16, generator=g), dim=-1)
    return image, F.normalize(image + 0.8 * torch.randn(11, 16, generator=g), dim=-1)


def _worker(local_rank: int, init_file: str, json_path: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=local_rank, world_size=WORLD)
    results: dict = {"rank": rank(), "world": world_size()}
    for loss in ("clip", "siglip"):
        model = _model(json_path, loss)
        images, tokens = _batch(model)
        rows = slice(local_rank * BATCH // WORLD, (local_rank + 1) * BATCH // WORLD)
        ddp = DistributedDataParallel(model)
        out = ddp(images[rows], tokens[rows])
        value = model.contrastive_loss(out)
        if loss == "clip":
            reference = ClipLoss(local_loss=True, gather_with_grad=True, rank=local_rank, world_size=WORLD)
            theirs = reference(out["image_features"], out["text_features"], out["logit_scale"])
        else:
            reference = SigLipLoss(rank=local_rank, world_size=WORLD)
            theirs = reference(out["image_features"], out["text_features"], out["logit_scale"], out["logit_bias"])
        value.backward()  # DDP averages the gradients over the 2 ranks here
        mean_loss = value.detach().clone()
        dist.all_reduce(mean_loss)
        results[loss] = {
            "loss": mean_loss.item() / WORLD,
            "local": value.item(),
            "open_clip": theirs.item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        }
    # Retrieval on uneven shares (7 + 4 rows): each rank scores its own queries against every
    # candidate, and the hits summed over ranks give the recall.
    image, text = _uneven_features()
    mine = slice(0, 7) if local_rank == 0 else slice(7, 11)
    hits = distributed_retrieval_hits(image[mine], text[mine])
    sums = torch.stack([h.sum() for h in hits.values()] + [torch.tensor(float(len(image[mine])))])
    dist.all_reduce(sums)
    results["retrieval"] = {key: float(sums[i] / sums[-1]) for i, key in enumerate(hits)}
    results["retrieval_rows"] = len(next(iter(hits.values())))
    torch.save(results, f"{out_file}.{local_rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory, tiny_clip_json) -> list[dict]:
    return run_two_ranks(_worker, tmp_path_factory.mktemp("dist"), tiny_clip_json)


def test_helpers_answer_rank_and_world(two_process_results):
    assert [r["rank"] for r in two_process_results] == [0, 1]
    assert all(r["world"] == WORLD for r in two_process_results)
    assert (rank(), world_size()) == (0, 1)  # this, undistributed, process


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_two_ranks_equal_one_process_on_the_whole_batch(two_process_results, tiny_clip_json, loss):
    ref_loss, ref_grads = _reference(tiny_clip_json, loss)
    for result in two_process_results:
        got = result[loss]
        assert got["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        # Each rank's share is what open_clip's own distributed loss computes.
        assert got["local"] == pytest.approx(got["open_clip"], rel=1e-5, abs=1e-6)
        assert set(got["grads"]) == set(ref_grads)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The bias only exists, and only learns, with the sigmoid loss.
    assert ("model.logit_bias" in ref_grads) == (loss == "siglip")


def test_retrieval_is_the_same_on_two_ranks_with_uneven_shares(two_process_results):
    image, text = _uneven_features()
    expected = retrieval_metrics(image, text)
    for result in two_process_results:
        assert result["retrieval"] == pytest.approx(expected)
    assert [r["retrieval_rows"] for r in two_process_results] == [7, 4]  # each scored its own only
    assert 0 < expected["i2t_R@1"] <= expected["i2t_R@5"] <= expected["i2t_R@10"] == 1.0


def test_gather_is_identity_without_a_process_group():
    x = torch.randn(3, 4, requires_grad=True)
    assert gather_with_grad(x) is x


def test_each_rank_draws_its_own_masks_from_the_run_seed():
    """CLIP (FLIP masks, dropout) and MAE offset the run's seed by the rank at fit start."""
    from mmssl.distributed import seed_per_rank

    draws = []
    for global_rank, ranks in ((0, 2), (1, 2), (1, 2), (0, 1)):
        torch.manual_seed(7)
        seed_per_rank(global_rank, ranks)
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])  # ranks differ
    assert torch.equal(draws[1], draws[2])  # deterministic from (seed, rank)
    torch.manual_seed(7)
    assert torch.equal(draws[3], torch.rand(4))  # one process keeps its stream


def test_gather_inside_a_process_group_of_one_keeps_rows_and_gradients():
    """The collectives' code path (sizes exchanged, the differentiable all-gather and its backward)
    in this process, on a gloo group of one rank; the 2-rank fixture above checks the sums over ranks."""
    if dist.is_initialized():
        pytest.skip("a process group is already up")
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}", rank=0, world_size=1)
        try:
            assert (rank(), world_size()) == (0, 1)
            g = torch.Generator().manual_seed(3)
            for same_size in (False, True):
                x = torch.randn(4, 3, generator=g).t().requires_grad_()  # (3, 4), not contiguous
                weights = torch.randn(3, 4, generator=g)
                out = gather_with_grad(x, same_size=same_size)
                assert out is not x and torch.equal(out, x)
                (out * weights).sum().backward()
                assert torch.equal(x.grad, weights), same_size  # one rank: its own gradient, once
        finally:
            dist.destroy_process_group()
