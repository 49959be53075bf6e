"""A CLIP + MLM (+ ITM) checkpoint exports its CLIP to open_clip: ``--format open_clip`` (a file) and
``open_clip_hf`` (a folder), without the MLM and ITM heads and without the mask token's embedding row,
with the bidirectional text tower (``no_causal_mask``); open_clip loads either strictly and computes
the module's embeddings. ``hf`` (a causal CLIPTextModel) and ``timm`` are refused, saying why."""

from __future__ import annotations

import contextlib
import io
import json
import re

import open_clip
import pytest
import torch
from safetensors.torch import load_file

from mmssl.export import export_checkpoint
from mmssl.export.hub import open_clip_export
from mmssl.models.clip_mlm import CLIPMLM
from mmssl.models.token_masking import MaskVocabulary
from tests.cli_runs import run_tool

# open_clip's BPE (49408 ids) and one row for the mask token; a bidirectional text tower.
MICRO = {"embed_dim": 32,
         "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
         "text_cfg": {"context_length": 16, "vocab_size": 49409, "width": 32, "heads": 2, "layers": 2,
                      "no_causal_mask": True}}
CAPTIONS = ["a small red circle", "A big, blue square!", "green star in the top-left (large)"]
ATOL = 1e-5


@pytest.fixture(scope="module", params=["clip", "siglip"])
def clip_mlm(request, tmp_path_factory):
    """A trained-looking CLIPMLM (every weight off its init; SigLIP's with a logit bias) and its checkpoint."""
    folder = tmp_path_factory.mktemp("clip_mlm")
    (folder / "clip_mlm_export_micro.json").write_text(json.dumps(MICRO))
    torch.manual_seed(0)
    module = CLIPMLM(str(folder / "clip_mlm_export_micro.json"), loss=request.param)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, folder / "last.ckpt")
    return module.eval(), folder / "last.ckpt"


def _embeddings(module_or_model, tokens, images):
    with torch.no_grad():
        return module_or_model.encode_image(images, normalize=False), module_or_model.encode_text(tokens,
                                                                                                   normalize=False)


def _check_same_embeddings(theirs: torch.nn.Module, module: CLIPMLM) -> None:
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens = module.tokenizer(CAPTIONS)
    image, text = _embeddings(module, tokens, images)
    their_image, their_text = _embeddings(theirs.eval(), tokens, images)
    torch.testing.assert_close(their_image, image, rtol=0, atol=ATOL)
    torch.testing.assert_close(their_text, text, rtol=0, atol=ATOL)
    assert theirs.logit_scale.item() == module.model.logit_scale.item()
    if module.model.logit_bias is not None:
        assert theirs.logit_bias.item() == module.model.logit_bias.item()


def test_open_clip_hf_folder_rebuilds_the_bidirectional_clip_without_the_mask_row(clip_mlm, tmp_path, monkeypatch):
    module, ckpt = clip_mlm
    folder = tmp_path / "oc"
    assert run_tool("export.py", ["--ckpt", str(ckpt), "--format", "open_clip_hf", "--output", str(folder)],
                    monkeypatch) == 0
    config = json.loads((folder / "open_clip_config.json").read_text())["model_cfg"]
    assert config["text_cfg"]["no_causal_mask"] is True
    assert config["text_cfg"]["vocab_size"] == 49408  # open_clip's BPE: the mask token's row is not the CLIP's
    state = load_file(folder / "open_clip_model.safetensors")
    assert state["token_embedding.weight"].shape == (49408, 32)
    torch.testing.assert_close(state["token_embedding.weight"], module.model.token_embedding.weight[:49408])
    assert not any(k.startswith(("mlm_head", "itm_head")) for k in state)
    theirs = open_clip.create_model("local-dir:" + str(folder), load_weights=False)
    theirs.load_state_dict(state, strict=True)
    assert theirs.attn_mask is None  # bidirectional, as trained
    assert torch.equal(open_clip.get_tokenizer("local-dir:" + str(folder))(CAPTIONS), module.tokenizer(CAPTIONS))
    _check_same_embeddings(theirs, module)
    _check_same_embeddings(open_clip.create_model("local-dir:" + str(folder)), module)  # open_clip's own loading


def test_open_clip_file_loads_strictly_into_the_plain_config(clip_mlm, tmp_path):
    module, ckpt = clip_mlm
    state = export_checkpoint(str(ckpt), "open_clip", str(tmp_path / "clip.safetensors"))
    assert load_file(tmp_path / "clip.safetensors").keys() == state.keys()
    # The module's config with open_clip's BPE vocabulary: what a user of the file registers.
    plain = json.loads(json.dumps(MICRO))
    plain["text_cfg"]["vocab_size"] = 49408
    (tmp_path / "clip_mlm_export_plain.json").write_text(json.dumps(plain))
    open_clip.add_model_config(str(tmp_path / "clip_mlm_export_plain.json"))
    bias = {"init_logit_bias": -10.0} if module.model.logit_bias is not None else {}  # the file's value wins
    theirs = open_clip.create_model("clip_mlm_export_plain", pretrained=str(tmp_path / "clip.safetensors"), **bias)
    _check_same_embeddings(theirs, module)
    # The file holds what the folder holds.
    folder_state, _ = open_clip_export(module)
    assert folder_state.keys() == state.keys()
    assert all(torch.equal(folder_state[k], state[k]) for k in state)


def test_a_tokenizer_with_its_own_mask_token_keeps_every_row(clip_mlm, monkeypatch):
    module, _ = clip_mlm
    # A Hugging Face tokenizer's [MASK] (BERT: 103 of 30522) is one of its ids: no row is the mask's alone.
    monkeypatch.setattr(module, "vocabulary", MaskVocabulary(103, 49409, (), None))
    state, config = open_clip_export(module)
    assert state["token_embedding.weight"].shape[0] == config["text_cfg"]["vocab_size"] == 49409


@pytest.mark.parametrize("format, why", [
    ("hf", "text tower is bidirectional.*CLIPTextModel is causal"),
    ("timm", "open_clip's own ViT, not a timm model"),
])
def test_formats_that_cannot_hold_it_are_refused_saying_why(clip_mlm, tmp_path, monkeypatch, format, why):
    _, ckpt = clip_mlm
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert run_tool("export.py", ["--ckpt", str(ckpt), "--format", format, "--output", str(tmp_path / "out")],
                        monkeypatch) == 1
    assert re.search(f"not a CLIPMLM one: .*{why}.*--format open_clip / open_clip_hf", err.getvalue()), err.getvalue()
    assert not (tmp_path / "out").exists()


def test_the_exported_folder_is_an_encoder_of_the_evaluation_tools(clip_mlm, tmp_path):
    from mmssl.evaluation.encoders import load_encoder

    module, ckpt = clip_mlm
    export_checkpoint(str(ckpt), "open_clip_hf", str(tmp_path / "oc"))
    encoder = load_encoder(str(tmp_path / "oc"))
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    tokens = encoder.tokenizer(CAPTIONS)
    assert torch.equal(tokens, module.tokenizer(CAPTIONS))
    with torch.no_grad():
        torch.testing.assert_close(encoder.encode_image(images), module.encode_image(images), rtol=0, atol=ATOL)
        torch.testing.assert_close(encoder.encode_text(tokens), module.encode_text(tokens), rtol=0, atol=ATOL)
