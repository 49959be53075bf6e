"""The chunked contrastive losses (``chunk_size``): the dense loss's value and every gradient, with
memory that follows the chunk, not the global batch; on 1 and 2 gloo processes, and through the
real CLI with GradCache on.

Features stand for one rank's view of a global batch: this rank's B rows (a slice at ``offset``
of the N gathered columns) against all N columns, as :func:`mmssl.objectives.contrastive_loss`
builds them. Three "ranks" of 4 (N = 12), so that a wrong offset cannot wrap round to the right
column; chunks that divide N (3), that do not (5: the positives of rank 1, columns 4..7, straddle
two blocks), one column at a time, N itself and more than N.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmssl.checkpoints import read_checkpoint
from mmssl.errors import ConfigError
from mmssl.losses import clip_loss, siglip_loss
from mmssl.objectives import contrastive_loss
from mmssl.objectives.contrastive import Contrastive
from tests.cli_runs import REPO, last_metrics, lockstep_runs
from tests.helpers import run_two_ranks

B, N, D = 4, 12, 8
CHUNKS = [1, 3, 5, 12, 50]
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def _inputs(dtype: torch.dtype, n: int = N, d: int = D, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=-1)  # (N, D)
    text = F.normalize(image + 0.7 * torch.randn(n, d, generator=g, dtype=dtype), dim=-1)  # (N, D), paired
    return {"image": image, "text": text, "scale": torch.tensor(7.0, dtype=dtype),
            "bias": torch.tensor(-4.0, dtype=dtype)}


def _loss_and_grads(kind: str, inputs: dict[str, torch.Tensor], offset: int, chunk: Optional[int],
                    rows: int = B) -> dict[str, torch.Tensor]:
    """The loss of rows [offset, offset + rows) against all columns, and its gradient w.r.t. every input."""
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    image, text = leaves["image"], leaves["text"]
    mine = slice(offset, offset + rows)
    if kind == "clip":
        loss = clip_loss(image[mine], text[mine], leaves["scale"], image, text, offset, chunk_size=chunk)
    else:
        loss = siglip_loss(image[mine], text[mine], leaves["scale"], leaves["bias"], text, offset, chunk_size=chunk)
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items() if v.grad is not None}
    return {"loss": loss.detach(), **grads}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0, 4, 8])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_chunked_loss_and_every_gradient_equal_the_dense_loss(kind, offset, dtype):
    inputs = _inputs(dtype)
    dense = _loss_and_grads(kind, inputs, offset, None)
    assert set(dense) == {"loss", "image", "text", "scale", *(["bias"] if kind == "siglip" else [])}
    assert dense["image"].abs().sum() > 0 and dense["text"].abs().sum() > 0  # the columns learn too
    tol = TOLERANCE[dtype]
    for chunk in CHUNKS:
        chunked = _loss_and_grads(kind, inputs, offset, chunk)
        assert chunked.keys() == dense.keys()
        for name, value in dense.items():
            assert chunked[name].dtype == value.dtype and chunked[name].shape == value.shape, name
            torch.testing.assert_close(chunked[name], value, rtol=tol, atol=tol, msg=f"{name}, chunk {chunk}")


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_vector_scalars_frozen_scalars_and_frozen_columns(kind):
    # FSDP's (1,)-shaped logit_scale / logit_bias (mmssl.models.scalars) keep their shape in the
    # gradient; a frozen scale and bias and frozen columns (a locked tower) get none and break nothing.
    inputs = {k: (v.reshape(1) if v.ndim == 0 else v) for k, v in _inputs(torch.float64).items()}
    dense, chunked = (_loss_and_grads(kind, inputs, 4, c) for c in (None, 5))
    for name, value in dense.items():
        assert chunked[name].shape == value.shape, name
        torch.testing.assert_close(chunked[name], value, rtol=1e-12, atol=1e-12, msg=name)
    for trained in ("scale", "bias")[:2 if kind == "siglip" else 1]:  # one scalar learning, the other frozen
        grads = []
        for chunk in (None, 5):
            leaves = {k: v.clone().requires_grad_(k == trained) for k, v in inputs.items()}
            image, text = leaves["image"], leaves["text"]
            if kind == "clip":
                loss = clip_loss(image[4:8], text[4:8], leaves["scale"], image, text, 4, chunk_size=chunk)
            else:
                loss = siglip_loss(image[4:8], text[4:8], leaves["scale"], leaves["bias"], text, 4, chunk_size=chunk)
            grads.append(torch.autograd.grad(loss, leaves[trained])[0])
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12, msg=trained)
    image, text = inputs["image"].clone().requires_grad_(), inputs["text"]
    if kind == "clip":
        loss = clip_loss(image[4:8], text[4:8], inputs["scale"], image, text, 4, chunk_size=5)
        reference = clip_loss(image[4:8], text[4:8], inputs["scale"], image, text, 4)
    else:
        loss = siglip_loss(image[4:8], text[4:8], inputs["scale"], inputs["bias"], text, 4, chunk_size=5)
        reference = siglip_loss(image[4:8], text[4:8], inputs["scale"], inputs["bias"], text, 4)
    (grad,) = torch.autograd.grad(loss, image)
    torch.testing.assert_close(grad, torch.autograd.grad(reference, image)[0], rtol=1e-12, atol=1e-12)


def test_bf16_autocast_is_replayed_in_the_backward():
    # Under autocast the blocks' matmuls run in bf16 in both passes, as the dense graph's do; the
    # gradients keep the features' dtype and stay within bf16 rounding of the dense ones.
    inputs = _inputs(torch.float32)
    for kind in ("clip", "siglip"):
        kinds: dict[Optional[int], set] = {}
        results = {}
        for chunk in (None, 5):
            spy = _Ops()
            with torch.autocast("cpu", dtype=torch.bfloat16), spy:
                results[chunk] = _loss_and_grads(kind, inputs, 4, chunk)
            kinds[chunk] = spy.matmul_dtypes
        assert kinds[5] == kinds[None] == {torch.bfloat16}, kinds
        for name, value in results[None].items():
            assert results[5][name].dtype == value.dtype, name
            torch.testing.assert_close(results[5][name], value, rtol=3e-2, atol=3e-2, msg=f"{kind} {name}")


def test_bad_chunks_and_offsets_are_refused():
    inputs = _inputs(torch.float32)
    image, text, scale = inputs["image"], inputs["text"], inputs["scale"]
    for chunk in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=r"chunk_size: an integer >= 1"):
            clip_loss(image[:4], text[:4], scale, image, text, 0, chunk_size=chunk)
        with pytest.raises(ValueError, match=r"chunk_size: an integer >= 1"):
            siglip_loss(image[:4], text[:4], scale, inputs["bias"], text, 0, chunk_size=chunk)
    for offset in (-1, 9):  # the positives of 4 rows at 9..12 or -1..2 fall outside the 12 columns
        with pytest.raises(ValueError, match=rf"offset {offset}: the positives of 4 rows fall outside the 12"):
            clip_loss(image[:4], text[:4], scale, image, text, offset, chunk_size=3)
        with pytest.raises(ValueError, match=rf"offset {offset}: the positives"):
            siglip_loss(image[:4], text[:4], scale, inputs["bias"], text, offset, chunk_size=3)
    assert clip_loss(image[:4], text[:4], scale, image, text, 8, chunk_size=3).isfinite()  # the last rank


# Memory --------------------------------------------------------------------------------------------


class _Ops(TorchDispatchMode):
    """Every op's outputs in the forward and the backward: the largest logit-shaped one (2-D, no
    feature dimension D), and the dtypes of the matrix products."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.d, self.largest, self.matmul_dtypes = d, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.ndim == 2 and self.d not in t.shape:
                self.largest = max(self.largest, t.numel())
        if func.__name__.startswith(("mm", "addmm")):
            self.matmul_dtypes.add(out.dtype)
        return out


def _memory(kind: str, n: int, chunk: Optional[int], rows: int = 16, d: int = 5) -> tuple[int, int]:
    """(bytes of the saved tensors other than features, largest logit-shaped tensor's elements)
    of one forward and backward of ``rows`` rows against ``n`` columns (``d`` a width that no
    other size here shares, so that a feature tensor is told apart by its shape)."""
    inputs = _inputs(torch.float32, n=n, d=d)
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if d not in t.shape:  # the features (N, D), (B, D) are the towers' outputs, held anyway
            saved[(t.untyped_storage().data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    spy = _Ops(d)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), spy:
        _loss_and_grads(kind, inputs, 0, chunk, rows=rows)
    return sum(saved.values()), spy.largest


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_saved_and_working_memory_grow_with_the_chunk_not_the_global_batch(kind):
    rows, chunk = 16, 8
    dense = {n: _memory(kind, n, None, rows) for n in (64, 128)}
    chunked = {n: _memory(kind, n, chunk, rows) for n in (64, 128)}
    wider = _memory(kind, 128, 2 * chunk, rows)
    # Dense: k (B, N) tensors saved (CLIP: a log-softmax per direction; SigLIP: the signs, the
    # signed logits and the logits), which double with N; and (B, N) temporaries.
    logits, k = rows * 64 * 4, (2 if kind == "clip" else 3)  # bytes of one fp32 (B, N = 64)
    assert k * logits <= dense[64][0] < (k + 1) * logits and dense[128][0] - dense[64][0] == k * logits
    assert dense[64][1] == rows * 64 and dense[128][1] == rows * 128
    # Chunked: no logits saved (per direction a (B,) log-partition, 64 bytes here), whatever N or
    # the chunk; the largest logit block is B x chunk in the forward and in the backward's
    # recomputation.
    assert chunked[64][0] == chunked[128][0] == wider[0] <= 2 * rows * 4 + 4
    assert chunked[64][1] == chunked[128][1] == rows * chunk and wider[1] == rows * 2 * chunk


# Two gloo processes ----------------------------------------------------------------------------------

WORLD = 2


def _worker(local_rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=local_rank, world_size=WORLD)
    inputs = _inputs(torch.float32, n=8, d=6)
    mine = slice(4 * local_rank, 4 * local_rank + 4)
    results = {}
    for kind in ("clip", "siglip"):
        for chunk in (None, 3):
            leaves = {"image": inputs["image"][mine].clone().requires_grad_(),
                      "text": inputs["text"][mine].clone().requires_grad_(),
                      "logit_scale": inputs["scale"].clone().requires_grad_(),
                      "logit_bias": inputs["bias"].clone().requires_grad_()}
            out = {"image_features": leaves["image"], "text_features": leaves["text"],
                   "logit_scale": leaves["logit_scale"], "logit_bias": leaves["logit_bias"]}
            shapes = set()

            def pack(t: torch.Tensor) -> torch.Tensor:
                shapes.add(tuple(t.shape))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = contrastive_loss(out, kind, chunk)
            loss.backward()
            bias = leaves["logit_bias"].grad  # the softmax loss has no bias
            total = torch.stack([loss.detach(), leaves["logit_scale"].grad, torch.zeros(()) if bias is None else bias])
            dist.all_reduce(total)  # DDP's mean over ranks: the loss and the scalars' gradients
            results[(kind, chunk)] = {"loss": total[0] / WORLD, "logit_scale": total[1] / WORLD,
                                      "logit_bias": total[2] / WORLD, "image": leaves["image"].grad / WORLD,
                                      "text": leaves["text"].grad / WORLD, "saved_shapes": shapes}
    torch.save(results, f"{out_file}.{local_rank}")
    dist.destroy_process_group()


def test_two_gloo_ranks_chunked_equal_one_process_dense(tmp_path):
    per_rank = run_two_ranks(_worker, tmp_path)
    inputs = _inputs(torch.float32, n=8, d=6)
    for kind in ("clip", "siglip"):
        whole = _loss_and_grads(kind, inputs, 0, None, rows=8)  # one process, the global batch
        for chunk in (None, 3):
            got = [r[(kind, chunk)] for r in per_rank]
            torch.testing.assert_close(got[0]["loss"], whole["loss"], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[0]["logit_scale"], whole["scale"], rtol=1e-6, atol=1e-6)
            if kind == "siglip":
                torch.testing.assert_close(got[0]["logit_bias"], whole["bias"], rtol=1e-6, atol=1e-6)
            for name in ("image", "text"):  # each rank's rows get the global batch's gradient
                torch.testing.assert_close(torch.cat([got[0][name], got[1][name]]), whole[name], rtol=1e-6,
                                           atol=1e-6, msg=f"{kind} {name} chunk {chunk}")
        for rank_results in per_rank:  # and the chunked loss is the dense one on each rank
            # (the dense one saves this rank's (4, 8) logits for the backward, the chunked one none)
            assert (4, 8) in rank_results[(kind, None)].pop("saved_shapes")
            assert not {(4, 8), (4, 3), (4, 2)} & rank_results[(kind, 3)].pop("saved_shapes")
            for name, value in rank_results[(kind, None)].items():
                torch.testing.assert_close(rank_results[(kind, 3)][name], value, rtol=1e-6, atol=1e-6, msg=name)


# The objective ---------------------------------------------------------------------------------------


def test_the_objective_takes_a_chunk_size_and_refuses_bad_ones(tiny_clip_json, monkeypatch):
    for bad in (0, -2, True, 2.5, "3"):
        with pytest.raises(ConfigError, match=r"^model.init_args.objectives.contrastive.chunk_size: an integer "
                                              r">= 1 \(or null\), got "):
            Contrastive(chunk_size=bad)
    assert Contrastive().chunk_size is None and Contrastive(chunk_size=3).chunk_size == 3
    import mmssl.losses
    from mmssl.models.clip import CLIP

    calls = []  # the chunks the chunked SigLIP loss ran with: in training and in validation
    chunked_siglip_loss = mmssl.losses.chunked_siglip_loss
    monkeypatch.setattr(mmssl.losses, "chunked_siglip_loss",
                        lambda *args: calls.append(args[-1]) or chunked_siglip_loss(*args))
    torch.manual_seed(0)
    plain = CLIP(tiny_clip_json, loss="siglip")
    torch.manual_seed(0)
    chunked = CLIP(tiny_clip_json, loss="siglip", objectives={"contrastive": {"chunk_size": 3}})
    assert chunked.objectives["contrastive"].chunk_size == 3 and chunked.objectives["contrastive"].loss == "siglip"
    images = torch.randn(5, 3, plain.image_size, plain.image_size, generator=torch.Generator().manual_seed(1))
    tokens = plain.tokenizer([f"a photo of {i}" for i in range(5)])
    values = []
    for model in (plain, chunked):
        (loss,) = model.losses(images, tokens)
        loss.backward()
        values.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        out = model.eval()(images, tokens)
        with torch.no_grad():
            values[-1] += (model.objectives["contrastive"].validation(out, {}),)
    (a, grads_a, val_a), (b, grads_b, val_b) = values
    assert calls == [3, 3]
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(val_b, val_a, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and "model.logit_bias" in grads_a
    for name, grad in grads_a.items():  # fp32 through the towers: the pure losses are held to 1e-6 above
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-6 * scale, msg=name)


# Through the CLI --------------------------------------------------------------------------------------

def test_two_ranks_with_chunked_loss_and_gradcache_train_what_one_dense_process_trains(tmp_path):
    """tests.cli_runs.lockstep_runs: 8 samples, 4 per rank on 2 ranks, 8 in one process, so every
    epoch is one global batch in both runs; SGD. The 2-process run chunks the
    loss's 8 columns 3 + 3 + 2 (both directions of CLIP's softmax loss, each rank's positives
    across blocks) and the towers 3 + 1 per rank (GradCache); the one-process run chunks nothing.
    Validation (zero-shot, retrieval, the loss) on. Both must end with the same weights."""
    def flags(processes: int) -> list[str]:
        chunk = 3 if processes == 2 else "null"
        return [
            "--model.init_args.loss=clip",
            # (JSON: a dotted key cannot reach into ``objectives`` while the config leaves it null)
            f'--model.init_args.objectives={{"contrastive": {{"chunk_size": {chunk}}}}}',
            f"--model.init_args.contrastive_chunk_size={chunk}",
            "--trainer.max_epochs=2", "--trainer.gradient_clip_val=0.5", "--trainer.log_every_n_steps=1",
        ]

    runs = {p: (params, last_metrics(run, ("val/", "epoch")))
            for p, (params, run) in lockstep_runs(tmp_path, str(REPO / "configs/demo/clip.yaml"), flags).items()}
    (two, two_metrics), (one, one_metrics) = runs[2], runs[1]
    assert two_metrics["epoch"] == one_metrics["epoch"] == 1
    assert {"val/loss", "val/zero_shot_top1", "val/i2t_R@1"} <= two_metrics.keys()
    # (val/loss is an in-batch loss: batches of 4 per rank against 8 in one process differ by design)
    for key in ("val/zero_shot_top1", "val/zero_shot_top5", "val/i2t_R@1", "val/i2t_R@5", "val/t2i_R@5"):
        assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-4, abs=1e-5), key
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-5, msg=name)
    for processes, chunk in ((2, 3), (1, None)):  # the option reached the model (and its checkpoint)
        (last,) = (tmp_path / f"p{processes}" / "runs").glob("version_0/checkpoints/last.ckpt")
        checkpoint = read_checkpoint(str(last))
        assert checkpoint["global_step"] == 2
        hparams = checkpoint["hyper_parameters"]
        assert hparams["objectives"]["contrastive"]["chunk_size"] == hparams["contrastive_chunk_size"] == chunk
