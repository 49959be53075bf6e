"""``model.grad_checkpointing`` and ``model.compile`` (mmssl.models.memory): the same loss and
gradients as without them, and checkpointing really recomputes (each block runs twice a step).

``compile`` is tested with the ``eager`` backend: dynamo traces and guards the blocks as with
inductor, without inductor's C++/Triton code generation (tens of seconds on a CPU); inductor's
numbers are the benchmark's (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmssl.models.classifier import ImageClassifier
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE
from mmssl.models.memory import compile_blocks, compile_options

MAE_TINY = dict(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2)
VIT_TINY = {"num_classes": 5, "image_size": 16, "model_kwargs": {"patch_size": 4, "embed_dim": 32, "depth": 2,
                                                                  "num_heads": 2}, "drop_path_rate": 0.0}


def _count_block_calls(blocks: nn.Module) -> list[int]:
    calls = [0]
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _grads(module: nn.Module, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    module.train()
    module.zero_grad()
    loss = loss_fn(module)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same(a, b) -> None:
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=1e-6, msg=name)


def _clip_loss(images, tokens):
    return lambda m: m.contrastive_loss(m(images, tokens))


def test_clip_checkpointing_keeps_loss_and_gradients(tiny_clip_json):
    torch.manual_seed(0)
    plain = CLIP(tiny_clip_json)
    torch.manual_seed(0)
    other = CLIP(tiny_clip_json, grad_checkpointing=True)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    tokens = plain.tokenizer(["a red circle", "a blue square", "a green star", "a big red square"])
    blocks = other.model.visual.transformer.resblocks
    calls = _count_block_calls(blocks)
    _assert_same(_grads(plain, _clip_loss(images, tokens)), _grads(other, _clip_loss(images, tokens)))
    assert calls[0] == 2 * len(blocks)  # the forward, then the recomputation in the backward


@pytest.mark.parametrize("model", ["clip", "mae"])
def test_compile_compiles_every_block_in_place(tiny_clip_json, model):
    """The wiring only (the first compiled step costs ~7 s even with the eager backend): every
    block of both towers compiled, parameter names (checkpoints) unchanged."""
    if model == "clip":
        plain, other = CLIP(tiny_clip_json), CLIP(tiny_clip_json, compile={"backend": "eager"})
        blocks = [*other.model.visual.transformer.resblocks, *other.model.transformer.resblocks]
    else:
        plain, other = MAE(**MAE_TINY), MAE(**MAE_TINY, compile={"backend": "eager"})
        blocks = [*other.encoder.blocks, *other.decoder.blocks]
    assert plain.state_dict().keys() == other.state_dict().keys()
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)


def test_mae_checkpointing_of_encoder_and_decoder_keeps_loss_and_gradients():
    torch.manual_seed(0)
    plain = MAE(**MAE_TINY)
    torch.manual_seed(0)
    other = MAE(**MAE_TINY, grad_checkpointing=True)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    noise = torch.rand(2, 16, generator=torch.Generator().manual_seed(2))
    encoder, decoder = _count_block_calls(other.encoder.blocks), _count_block_calls(other.decoder.blocks)
    _assert_same(_grads(plain, lambda m: m(images, noise=noise)[0]), _grads(other, lambda m: m(images, noise=noise)[0]))
    assert encoder[0] == 2 * MAE_TINY["depth"] and decoder[0] == 2 * MAE_TINY["decoder_depth"]
    with torch.no_grad():  # no recomputation without gradients (validation, probes)
        other(images, noise=noise)
    assert encoder[0] == 3 * MAE_TINY["depth"]


def test_classifier_checkpointing_keeps_loss_and_gradients():
    images, labels = torch.randn(2, 3, 16, 16), torch.tensor([1, 3])
    torch.manual_seed(0)
    plain = ImageClassifier(**VIT_TINY)
    torch.manual_seed(0)
    other = ImageClassifier(**VIT_TINY, grad_checkpointing=True)
    calls = _count_block_calls(other.model.blocks)
    loss = lambda m: nn.functional.cross_entropy(m(images), labels)  # noqa: E731
    _assert_same(_grads(plain, loss), _grads(other, loss))
    assert calls[0] == 2 * len(other.model.blocks)


def test_compile_options_and_refusals():
    assert compile_options(False) is None and compile_options(True) == {}
    assert compile_options({"mode": "max-autotune"}) == {"mode": "max-autotune"}
    with pytest.raises(ValueError, match="model.compile"):
        compile_options("yes")
    with pytest.raises(ValueError, match=r"model.compile: the MLP \(Sequential\) has no transformer block list"):
        compile_blocks(nn.Sequential(nn.Linear(2, 2)), {}, "the MLP")
