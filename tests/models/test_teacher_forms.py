"""Each form a teacher is read from gives the teacher its file holds, named and hashed as the student
records it: a bidirectional text tower reads trimmed tokens padded as open_clip pads them, a SigLIP
keeps its logit bias, an HF tokenizer's folder decides the signature, a transformers folder is a
``hf`` teacher with its own signature and unit embeddings, a timm folder and unreadable files are
refused naming the teacher option and the file (see also test_teacher_edges.py)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mmssl.checkpoints.layouts import clip_to_open_clip
from mmssl.checkpoints.read import UnsafeCheckpointError
from mmssl.export.hub import write_open_clip_hf
from mmssl.models.clip import CLIP
from mmssl.models.open_clip_config import create_model, resolve_model_name
from mmssl.models.teacher import KEY, _read, load_teacher, sha256, tokenizer_signature
from tests.checkpoints.test_folders import CAPTIONS, _clip, _word_tokenizer
from tests.conftest import TINY_CLIP
from tests.models.test_distill import save_lightning


def _config(tmp_path, name: str, **text) -> str:
    config = json.loads(json.dumps(TINY_CLIP))
    config["text_cfg"].update(text)
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    return str(tmp_path / f"{name}.json")


def test_a_bidirectional_teacher_reads_trimmed_tokens_padded_as_open_clip_pads_them(tmp_path):
    """A CLIP + MLM's text tower attends to every position: the student's trimmed batch, padded back
    with open_clip's 0, embeds as the untrimmed tokens do; padded with another id it would not."""
    module = _clip(_config(tmp_path, "bidirectional", no_causal_mask=True))
    teacher = load_teacher(str(save_lightning(module, tmp_path / "bidirectional.ckpt")))
    tokens = teacher.tokenizer(CAPTIONS)
    assert tokens.shape[1] == teacher.context_length == 16 and tokens[:, -1].eq(0).all()
    used = int(tokens.ne(0).sum(1).max())
    with torch.no_grad():
        full = teacher.encode_text(tokens)
        assert torch.equal(teacher.encode_text(tokens[:, :used]), full)
        assert torch.equal(teacher.encode_text(tokens[:, :1]), teacher.encode_text(F.pad(tokens[:, :1], (0, 15))))
        other = F.pad(tokens[:, :used], (0, 16 - used), value=1)
        assert (teacher.encode_text(other) - full).abs().max() > 1e-3  # the pads are read: the check can fail
        torch.testing.assert_close(full, module.encode_text(tokens), rtol=0, atol=2e-5)
        assert torch.allclose(full.norm(dim=-1), torch.ones(len(CAPTIONS)))


@pytest.mark.parametrize("form", ["lightning", "state_dict"])
def test_a_siglip_teacher_keeps_its_logit_bias_from_the_weights(form, tiny_clip_json, tmp_path):
    module = CLIP(tiny_clip_json, loss="siglip")
    with torch.no_grad():
        module.model.logit_bias.fill_(-7.25)
        module.model.logit_scale.fill_(2.5)
    path = save_lightning(module, tmp_path / "siglip.ckpt")
    if form == "state_dict":
        torch.save(clip_to_open_clip(torch.load(path, weights_only=True)["state_dict"]), tmp_path / "siglip.pt")
        path = tmp_path / "siglip.pt"
    teacher = load_teacher(str(path), tiny_clip_json if form == "state_dict" else None)
    assert teacher.model.logit_bias.item() == -7.25
    assert teacher.logit_scale.item() == pytest.approx(torch.tensor(2.5).exp().item())
    assert teacher.source == str(path) and teacher.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_weights_that_do_not_fit_are_refused_with_the_first_line_of_torchs_error(tiny_clip_json, tmp_path):
    state = clip_to_open_clip(CLIP(tiny_clip_json).state_dict())
    torch.save(state, tmp_path / "clip.pt")
    wider = _config(tmp_path, "wider", width=48)
    name = resolve_model_name(wider)
    with pytest.raises(RuntimeError) as torchs:
        create_model(name).load_state_dict(state)
    with pytest.raises(ValueError) as info:
        load_teacher(str(tmp_path / "clip.pt"), wider)
    assert str(info.value) == (f"{KEY}: the weights of {tmp_path / 'clip.pt'} do not fit open_clip model {name!r}: "
                               f"{str(torchs.value).splitlines()[0]} (name the right one with "
                               "model.init_args.distill.teacher_model)")
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_checkpoints_hugging_face_tokenizer_folder_decides_its_signature(tmp_path):
    """The tokenizer folder a checkpoint records (or the one passed, which wins) is the teacher's,
    and what its signature names: the student's tokens serve it only for the same folder."""
    tokenizer, other = tmp_path / "tokenizer", tmp_path / "other"
    _word_tokenizer(tokenizer)
    _word_tokenizer(other)
    config = _config(tmp_path, "words", vocab_size=9, hf_tokenizer_name="local/tiny")
    module = _clip(config, str(tokenizer))
    path = save_lightning(module, tmp_path / "words.ckpt")
    name = resolve_model_name(config)
    teacher = load_teacher(str(path))
    assert teacher.signature == tokenizer_signature(name, str(tokenizer))
    assert teacher.signature[2] == os.path.abspath(tokenizer)
    assert torch.equal(teacher.tokenizer(CAPTIONS), module.tokenizer(CAPTIONS))
    passed = load_teacher(str(path), tokenizer_dir=str(other))
    assert passed.signature == tokenizer_signature(name, str(other)) != teacher.signature
    # A state dict records no tokenizer: the one passed is the teacher's.
    state = tmp_path / "words.pt"
    torch.save(clip_to_open_clip(module.state_dict()), state)
    from_state = load_teacher(str(state), config, str(tokenizer))
    assert from_state.signature == teacher.signature
    assert torch.equal(from_state.tokenizer(CAPTIONS), module.tokenizer(CAPTIONS))


def test_a_checkpoint_without_its_model_name_takes_the_teacher_model(tiny_clip_json, tmp_path):
    module = _clip(tiny_clip_json)
    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {"_class_path": "mmssl.models.clip.CLIP"}},
               bare)
    with pytest.raises(ValueError) as info:
        load_teacher(str(bare))
    assert str(info.value) == f"{KEY}: {bare} records no model_name: pass model.init_args.distill.teacher_model"
    teacher = load_teacher(str(bare), tiny_clip_json)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(teacher.encode_image(images), module.encode_image(images), rtol=0, atol=2e-5)
    # The name passed overrides the one recorded: a wider model does not fit these weights.
    with pytest.raises(ValueError, match="do not fit open_clip model"):
        load_teacher(str(save_lightning(module, tmp_path / "named.ckpt")), _config(tmp_path, "wide", width=48))


def test_a_transformers_folder_is_an_hf_teacher_with_its_own_signature_and_unit_embeddings(tiny_clip_json,
                                                                                           tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from mmssl.export.hf import write_hf

    module = _clip(tiny_clip_json)
    folder = str(tmp_path / "hf")
    write_hf(module, folder)
    teacher = load_teacher(folder)
    assert teacher.hf and teacher.source == folder and teacher.signature == ("transformers", os.path.abspath(folder))
    assert (teacher.context_length, teacher.embed_dim) == (16, 32)
    assert teacher.sha256 == hashlib.sha256(open(os.path.join(folder, "model.safetensors"), "rb").read()).hexdigest()
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"not read")  # safetensors first, as transformers reads
    monkeypatch.chdir(tmp_path)  # a relative folder: its signature is the absolute path, as the student's
    relative = load_teacher("hf")
    assert relative.signature == teacher.signature and relative.sha256 == teacher.sha256
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tokens = teacher.tokenizer(CAPTIONS)
    with torch.no_grad():
        image, text = teacher.encode_image(images), teacher.encode_text(tokens[:, :8])
        raw_image = teacher.model.get_image_features(pixel_values=images)
        raw_image = getattr(raw_image, "pooler_output", raw_image)
    torch.testing.assert_close(image, F.normalize(raw_image, dim=-1), rtol=0, atol=0)
    assert torch.allclose(image.norm(dim=-1), torch.ones(2)) and torch.allclose(text.norm(dim=-1), torch.ones(4))
    with torch.no_grad():
        torch.testing.assert_close(text, module.encode_text(module.tokenizer(CAPTIONS)), rtol=0, atol=2e-5)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    # transformers before 5 returned the projected features as a tensor (5 returns an output whose
    # pooler_output they are): the teacher reads either.
    model = teacher.model
    for name in ("get_image_features", "get_text_features"):
        newer = getattr(model, name)
        monkeypatch.setattr(model, name, lambda newer=newer, **inputs: getattr(newer(**inputs), "pooler_output"))
    with torch.no_grad():
        assert torch.equal(teacher.encode_image(images), image)
        assert torch.equal(teacher.encode_text(tokens[:, :8]), text)


def test_an_open_clip_hub_folder_teacher_is_named_and_hashed_by_its_weights_file(tiny_clip_json, tmp_path):
    folder = tmp_path / "oc"
    write_open_clip_hf(_clip(tiny_clip_json), str(folder))
    teacher = load_teacher(str(folder))
    weights = (folder / "open_clip_model.safetensors").read_bytes()
    assert not teacher.hf and teacher.source == str(folder)
    assert teacher.sha256 == hashlib.sha256(weights).hexdigest()
    assert teacher.signature == tokenizer_signature(resolve_model_name(tiny_clip_json), None)
    weights_file = folder / "open_clip_model.safetensors"
    weights_file.write_bytes(weights[: len(weights) // 2])  # a copy cut short
    with pytest.raises(ValueError) as info:
        load_teacher(str(folder))
    assert str(info.value).startswith(f"{KEY}: {folder} is not a readable checkpoint (SafetensorError: ")
    weights_file.write_bytes(weights)
    # open_clip's older hub folders hold only the pickle-free .bin state dict: read and hashed the same way.
    torch.save(load_file(str(folder / "open_clip_model.safetensors")), folder / "open_clip_pytorch_model.bin")
    (folder / "open_clip_model.safetensors").unlink()
    older = load_teacher(str(folder))
    assert older.sha256 == hashlib.sha256((folder / "open_clip_pytorch_model.bin").read_bytes()).hexdigest()
    (folder / "open_clip_pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_teacher(str(folder))
    assert str(info.value) == (f"{KEY}: {folder}: no weights file (open_clip_model.safetensors or "
                               "open_clip_pytorch_model.bin)")


def test_a_timm_folder_is_refused_as_an_image_model(tmp_path):
    folder = tmp_path / "timm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as info:
        load_teacher(str(folder))
    assert str(info.value) == f"{KEY}: {folder} is a timm export folder, an image model only; a teacher is a CLIP"


def test_the_hash_is_of_the_whole_file_read_in_blocks(tmp_path):
    big = tmp_path / "big.bin"  # over one read block
    big.write_bytes(bytes(range(256)) * 5000)
    assert sha256(str(big)) == hashlib.sha256(big.read_bytes()).hexdigest()


def _raise(err: BaseException):
    def read():
        raise err
    return read


@pytest.mark.parametrize("kind", [FileNotFoundError, UnsafeCheckpointError, ImportError])
def test_an_unreadable_teacher_keeps_its_error_type_and_names_the_option(kind):
    with pytest.raises(kind) as info:
        _read(_raise(kind("no tokenizer in /x")), "/t.ckpt")
    assert str(info.value) == f"{KEY}: no tokenizer in /x" and info.value.__cause__ is None


def test_a_value_or_key_error_names_the_option_once():
    with pytest.raises(ValueError) as info:
        _read(_raise(ValueError("bad layout")), "/t.ckpt")
    assert str(info.value) == f"{KEY}: bad layout" and info.value.__suppress_context__
    with pytest.raises(ValueError) as info:
        _read(_raise(ValueError(f"{KEY}: already named")), "/t.ckpt")
    assert str(info.value) == f"{KEY}: already named"
    with pytest.raises(KeyError) as info:
        _read(_raise(KeyError("state_dict")), "/t.ckpt")
    assert info.value.args == (f"{KEY}: state_dict",)
    with pytest.raises(ValueError) as info:
        _read(_raise(ValueError()), "/t.ckpt")
    assert str(info.value) == f"{KEY}: "
    assert _read(lambda: 5, "/t.ckpt") == 5


def test_a_truncated_teacher_file_is_refused_naming_it(tiny_clip_json, tmp_path):
    path = save_lightning(CLIP(tiny_clip_json), tmp_path / "t.ckpt")
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ValueError) as info:
        load_teacher(str(path))
    assert str(info.value).startswith(f"{KEY}: {path} is not a readable checkpoint (RuntimeError: ")
    with pytest.raises(ValueError) as info:
        _read(_raise(RuntimeError("zip")), "/t.ckpt")
    assert str(info.value) == f"{KEY}: /t.ckpt is not a readable checkpoint (RuntimeError: zip)"
