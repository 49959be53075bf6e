"""The edges of mmssl.models.teacher that tests/models/test_distill.py leaves open: the teacher
following the student's device and half precision, what decides that the student's tokens serve
it, and each refusal's exact message (a folder without weights, a state dict without its model,
weights of another model, no file)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from mmssl.checkpoints.layouts import clip_to_open_clip
from mmssl.models.clip import CLIP
from mmssl.models.open_clip_config import resolve_model_name
from mmssl.models.teacher import KEY, load_teacher, sha256, tokenizer_signature
from tests.models.test_distill import save_lightning


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory, tiny_clip_json):
    torch.manual_seed(3)
    return save_lightning(CLIP(tiny_clip_json), tmp_path_factory.mktemp("teacher") / "teacher.ckpt")


def test_the_teacher_follows_the_students_device_and_half_precision(teacher_file):
    teacher = load_teacher(str(teacher_file))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        full = teacher.encode_image(images)
    teacher.follow(images.to(torch.bfloat16))
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        half = teacher.encode_image(images.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), full, atol=0.05)
    teacher.follow(images)  # float32 images: the teacher keeps its dtype (a mixed-precision run's autocast)
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}
    teacher.follow(torch.zeros(1, 3, 32, 32, device="meta"))  # where a GPU batch is
    assert {p.device.type for p in teacher.parameters()} == {"meta"}
    assert not teacher.training and teacher.train().training is False  # always in eval mode


def test_the_tokens_serve_a_teacher_of_the_same_tokenizer_signature(tiny_clip_json, tmp_path):
    name = resolve_model_name(tiny_clip_json)
    assert tokenizer_signature(name, None) == ("open_clip", None, None, 16, "{}")
    assert tokenizer_signature(name, str(tmp_path)) == ("open_clip", None, None, 16, "{}")  # BPE: no folder


def test_refusals_name_the_teacher_option_and_the_file(tmp_path, teacher_file, tiny_clip_json):
    with pytest.raises(FileNotFoundError) as info:
        load_teacher(str(tmp_path / "none.ckpt"))
    assert str(info.value) == f"{KEY}: no teacher file or folder at {str(tmp_path / 'none.ckpt')!r}"
    assert sha256(str(teacher_file)) == hashlib.sha256(teacher_file.read_bytes()).hexdigest()
    state = tmp_path / "open_clip.pt"
    torch.save(clip_to_open_clip(torch.load(teacher_file, weights_only=True)["state_dict"]), state)
    with pytest.raises(ValueError) as info:
        load_teacher(str(state))
    assert str(info.value) == (f"{KEY}: {state} is a state dict: name its open_clip model or JSON config with "
                               "model.init_args.distill.teacher_model")
    wider = json.loads(open(tiny_clip_json).read())
    wider["vision_cfg"]["width"] = 48
    (tmp_path / "wider.json").write_text(json.dumps(wider))
    with pytest.raises(ValueError) as info:
        load_teacher(str(state), str(tmp_path / "wider.json"))
    name = resolve_model_name(str(tmp_path / "wider.json"))
    assert str(info.value).startswith(f"{KEY}: the weights of {state} do not fit open_clip model {name!r}: ")
    assert str(info.value).endswith("(name the right one with model.init_args.distill.teacher_model)")
    teacher = load_teacher(str(state), tiny_clip_json)
    assert teacher.source == str(state) and teacher.embed_dim == 32 and teacher.image_size == 32


@pytest.mark.parametrize("text", [{}, {"proj_bias": True}, {"proj_type": "none", "embed_dim": 32}])
def test_a_teachers_width_is_its_embedding_width_not_its_text_towers(text, tiny_clip_json, tmp_path):
    """A teacher whose text tower is wider than its embedding (RN50: 512 wide, 1024-d embeddings;
    here 32 and 24): its width, which the distillation projection and stored embeddings check, is
    the embedding's, whether open_clip projects the text with a matrix, a ``Linear`` (``proj_bias``,
    which once failed with AttributeError) or not at all (``proj_type: none``, the tower's width)."""
    config = json.loads(open(tiny_clip_json).read())
    text = dict(text)  # the parameter's own dict is shared with a rerun
    config["embed_dim"] = text.pop("embed_dim", 24)
    config["text_cfg"].update(text)
    (tmp_path / "narrow.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    teacher = load_teacher(str(save_lightning(CLIP(str(tmp_path / "narrow.json")), tmp_path / "narrow.ckpt")))
    assert teacher.embed_dim == config["embed_dim"]
    with torch.no_grad():
        assert teacher.encode_text(torch.ones(2, 16, dtype=torch.long)).shape == (2, teacher.embed_dim)
        assert teacher.encode_image(torch.randn(2, 3, 32, 32)).shape == (2, teacher.embed_dim)
