"""GradCache (``model.contrastive_chunk_size``): a chunked step is the whole-batch step.

Every comparison runs with FLIP masking on. The masks a chunked step draws are recorded and
checked against the whole-batch step's (one process: the CPU generator draws serially, so the same
seed gives the same masks) or replayed into it (2 ranks against one process), so equality of the
loss and gradients is not an accident of identical-looking random draws.
"""

from __future__ import annotations

import contextlib
import json
from typing import Iterator, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import mmssl.models.flip as flip_module
import mmssl.models.gradcache as gradcache_module
from mmssl.callbacks.guards import NonFiniteGuard
from mmssl.models.clip import CLIP
from mmssl.models.masking import Masking
from tests.helpers import run_two_ranks

BATCH = 8
CAPTIONS = [f"a {c} {s}" for c in ("red", "blue") for s in ("circle", "square", "star", "cross")]
WORLD = 2


def _model(json_path: str, loss: str, chunk: Optional[int]) -> CLIP:
    torch.manual_seed(0)  # the same initial weights in every model and process
    return CLIP(json_path, loss=loss, flip={"mask_ratio": 0.5}, contrastive_chunk_size=chunk).train()


def _batch(model: CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 3, model.image_size, model.image_size, generator=g), model.tokenizer(CAPTIONS)


@contextlib.contextmanager
def flip_masks(replay: Optional[Masking] = None) -> Iterator[list[tuple[torch.Tensor, Masking]]]:
    """Record every FLIP ``random_masking`` call as (patch tokens, masking); or hand out ``replay``."""
    calls: list[tuple[torch.Tensor, Masking]] = []
    original = flip_module.random_masking

    def recording(x: torch.Tensor, ratio: float, *args, **kwargs) -> Masking:
        masking = replay if replay is not None else original(x, ratio, *args, **kwargs)
        calls.append((x.detach().clone(), masking))
        return masking

    flip_module.random_masking = recording
    try:
        yield calls
    finally:
        flip_module.random_masking = original


def _cat(maskings: list[Masking]) -> Masking:
    return Masking(*(torch.cat(parts) for parts in zip(*maskings)))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(got: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert set(got) == set(expected)
    for name, ref in expected.items():
        # relative 1e-5, elementwise, with entries near 0 judged against the tensor's scale
        torch.testing.assert_close(got[name], ref, rtol=rtol, atol=rtol * float(ref.abs().max()), msg=name)


def _step(model: CLIP, replay: Optional[Masking] = None):
    images, tokens = _batch(model)
    torch.manual_seed(5)
    with flip_masks(replay) as calls:
        loss = model.contrastive_loss(model(images, tokens))
        forward_calls = len(calls)
        loss.backward()
    return loss.item(), _grads(model), calls[:forward_calls], calls[forward_calls:]


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_chunked_step_equals_the_whole_batch_step(tiny_clip_json, loss):
    ref_loss, ref_grads, ref_masks, _ = _step(_model(tiny_clip_json, loss, None))
    # Chunks of 3: 3 + 3 + 2, an uneven last chunk.
    got_loss, got_grads, first, second = _step(_model(tiny_clip_json, loss, 3))
    assert [m.ids_keep.shape[0] for _, m in first] == [3, 3, 2]  # masks drawn chunk by chunk ...
    assert len(second) == 3  # ... and again in the backward's recomputation
    assert torch.equal(_cat([m for _, m in first]).ids_keep, ref_masks[0][1].ids_keep)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5)
    _assert_grads_equal(got_grads, ref_grads)
    assert ("model.logit_bias" in got_grads) == (loss == "siglip")


def test_chunk_size_is_checked(tiny_clip_json):
    with pytest.raises(ValueError, match="model.contrastive_chunk_size"):
        _model(tiny_clip_json, "clip", 0)


def test_no_grad_forward_in_chunks_gives_the_same_features(tiny_clip_json):
    model = _model(tiny_clip_json, "clip", None).eval()
    images, tokens = _batch(model)
    with torch.no_grad():
        whole = model(images, tokens)
        image, text = gradcache_module.cached_features(model._encode_pair, images, tokens, 3)
    torch.testing.assert_close(image, whole["image_features"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(text, whole["text_features"], rtol=1e-5, atol=1e-6)


def _fit(json_path: str, chunk: Optional[int]) -> dict[str, torch.Tensor]:
    """2 optimizer steps of Lightning's automatic optimization, each accumulating 2 batches of 8."""
    torch.manual_seed(0)
    # SGD: Adam would turn the key bias's zero gradient (softmax ignores it; float noise, chunked
    # or not) into a full-size step in a random direction, hiding what is compared here.
    model = CLIP(json_path, flip={"mask_ratio": 0.5}, contrastive_chunk_size=chunk, warmup_steps=1,
                 optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9))
    images, tokens = _batch(model)
    batches = [{"image": images.roll(i, dims=0), "text": tokens.roll(i, dims=0)} for i in range(4)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5,
        callbacks=[NonFiniteGuard()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(5)
    trainer.fit(model, DataLoader(batches, batch_size=None))
    assert trainer.global_step == 2
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fit_with_accumulation_and_clipping_equals_the_unchunked_fit(tiny_clip_json):
    """Lightning's one backward per batch is kept: accumulation, clipping, schedule, guard unchanged."""
    plain, chunked = _fit(tiny_clip_json, None), _fit(tiny_clip_json, 3)
    torch.manual_seed(0)
    start = CLIP(tiny_clip_json).state_dict()
    assert not torch.equal(plain["model.visual.conv1.weight"], start["model.visual.conv1.weight"])
    for name, value in plain.items():
        torch.testing.assert_close(chunked[name], value, rtol=1e-5, atol=1e-6, msg=name)


# The second pass replays each chunk's random state: FLIP masks and drop path, on a timm tower.

TIMM_DROP_PATH = {
    "embed_dim": 32,
    "vision_cfg": {"timm_model_name": "test_vit", "timm_model_pretrained": False, "timm_pool": "token",
                   "timm_proj": "linear", "image_size": 32, "timm_drop_path": 0.5},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def _chunk_forwards(model: CLIP, preserve_rng_state: bool) -> list[tuple[torch.Tensor, torch.Tensor, list]]:
    """One record per forward of a chunk: (FLIP input, ids_keep, drop-path keep flags per block)."""
    events: list = []  # in call order: a chunk's FLIP masking, then its blocks' drop paths
    hooks = [m.register_forward_hook(lambda mod, inp, out: events.append(out.flatten(1).abs().sum(1) != 0))
             for m in model.modules() if type(m).__name__ == "DropPath"]
    assert len(hooks) >= 2  # timm's drop-path rule: 0 in the first block, rising with depth
    images, tokens = _batch(model)
    masking, checkpoint = flip_module.random_masking, gradcache_module.checkpoint

    def recording(x: torch.Tensor, ratio: float, **kwargs) -> Masking:
        out = masking(x, ratio, **kwargs)
        events.append((x.detach().clone(), out.ids_keep))
        return out

    flip_module.random_masking = recording
    if not preserve_rng_state:
        gradcache_module.checkpoint = lambda *a, **k: checkpoint(*a, **{**k, "preserve_rng_state": False})
    try:
        torch.manual_seed(3)
        model.contrastive_loss(model(images, tokens)).backward()
    finally:
        flip_module.random_masking, gradcache_module.checkpoint = masking, checkpoint
        for h in hooks:
            h.remove()
    starts = [i for i, e in enumerate(events) if isinstance(e, tuple)] + [len(events)]
    return [(*events[a], events[a + 1:b]) for a, b in zip(starts, starts[1:])]


def _replayed(records: list) -> bool:
    """Whether each chunk's second forward saw the masks and drop-path draws of its first."""
    chunks = len(records) // 2
    first, second = records[:chunks], records[chunks:]
    for x, ids_keep, drops in second:
        (twin,) = [r for r in first if torch.equal(r[0], x)]  # the same chunk's first forward
        if not (torch.equal(twin[1], ids_keep) and all(torch.equal(a, b) for a, b in zip(twin[2], drops))):
            return False
    return True


def test_second_pass_replays_flip_masks_and_drop_path(tmp_path):
    path = tmp_path / "clip_timm_drop_path.json"
    path.write_text(json.dumps(TIMM_DROP_PATH))
    model = CLIP(str(path), flip={"mask_ratio": 0.5}, contrastive_chunk_size=2).train()
    records = _chunk_forwards(model, preserve_rng_state=True)
    assert len(records) == 2 * BATCH // 2  # 4 chunks, each run twice
    masks = [r[1] for r in records[:4]]
    assert any(not torch.equal(masks[0], m) for m in masks[1:])  # chunks draw their own masks ...
    drops = torch.cat([torch.stack(r[2]) for r in records[:4]], dim=1)  # (blocks x 2, B)
    assert 0 < int(drops.sum()) < drops.numel()  # ... and drop paths, some dropped, some kept
    assert _replayed(records)
    # Control: without restoring the random state, the recomputation draws other masks.
    model.zero_grad()
    assert not _replayed(_chunk_forwards(model, preserve_rng_state=False))


# 2 gloo processes, chunked, against one process on the concatenated batch (test_distributed.py).

def _counting_hook(counts: list[int]):
    def hook(state, bucket):
        counts[0] += 1
        return allreduce_hook(None, bucket)

    return hook


def _worker(local_rank: int, init_file: str, json_path: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=local_rank, world_size=WORLD)
    rows = slice(local_rank * BATCH // WORLD, (local_rank + 1) * BATCH // WORLD)
    results: dict = {}
    for loss in ("clip", "siglip"):
        for chunk in (None, 3):  # 4 rows per rank: chunks of 3 + 1
            model = _model(json_path, loss, chunk)
            images, tokens = _batch(model)
            ddp = DistributedDataParallel(model)
            reductions = [0]
            ddp.register_comm_hook(None, _counting_hook(reductions))
            torch.manual_seed(11 + local_rank)
            with flip_masks() as calls:
                value = model.contrastive_loss(ddp(images[rows], tokens[rows]))
                forward_calls = len(calls)
                value.backward()  # DDP averages the gradients over the 2 ranks
            mean_loss = value.detach().clone()
            dist.all_reduce(mean_loss)
            results[loss, chunk] = {
                "loss": mean_loss.item() / WORLD, "grads": _grads(model), "reductions": reductions[0],
                "masks": _cat([m for _, m in calls[:forward_calls]]),
            }
    torch.save(results, f"{out_file}.{local_rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory, tiny_clip_json) -> list[dict]:
    return run_two_ranks(_worker, tmp_path_factory.mktemp("gradcache_dist"), tiny_clip_json)


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_two_ranks_chunked_equal_one_process_on_the_whole_batch(two_process_results, tiny_clip_json, loss):
    # One process on the concatenated batch, with the masks the two ranks drew in their first pass.
    masks = _cat([r[loss, 3]["masks"] for r in two_process_results])
    ref_loss, ref_grads, _, _ = _step(_model(tiny_clip_json, loss, None), replay=masks)
    for result in two_process_results:
        chunked, plain = result[loss, 3], result[loss, None]
        assert chunked["loss"] == pytest.approx(ref_loss, rel=1e-5)
        _assert_grads_equal(chunked["grads"], ref_grads)
        # One all-reduce per gradient bucket per step, as without chunking: not one per chunk.
        assert chunked["reductions"] == plain["reductions"] >= 1
