"""mmssl.checkpoints.folders: the one builder of an export folder's model. The distillation teacher
(load_teacher) and the evaluation encoder (load_encoder) built from the same folder tokenise,
embed and preprocess alike, and an open_clip hub folder's Hugging Face tokenizer is read from the
folder itself, or from the teacher's tokenizer folder, never downloaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmssl.checkpoints.folders import build_folder
from mmssl.evaluation.encoders import load_encoder
from mmssl.export.hub import write_open_clip_hf
from mmssl.models.clip import CLIP
from mmssl.models.open_clip_config import resolve_model_name
from mmssl.models.teacher import KEY, load_teacher, tokenizer_signature
from tests.conftest import TINY_CLIP

# HTML entities: open_clip unescapes them in training (SimpleTokenizer), transformers' CLIPTokenizer does not.
CAPTIONS = ["a red circle", "a blue  square", "A STAR", "salt &amp; pepper"]
WORDS = ["a", "red", "blue", "circle", "square", "star"]


def _clip(config: str, tokenizer=None) -> CLIP:
    torch.manual_seed(7)
    module = CLIP(config, tokenizer=tokenizer).eval()
    with torch.no_grad():  # away from the init: a wrong or half-loaded weight shows
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return module


def _alike(teacher, encoder, module: CLIP) -> None:
    """The teacher and the encoder agree exactly, and with the module they were exported from."""
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens = teacher.tokenizer(CAPTIONS)
    assert torch.equal(encoder.tokenizer(CAPTIONS), tokens)
    with torch.no_grad():
        image, text = teacher.encode_image(images), teacher.encode_text(tokens)
        assert torch.equal(encoder.encode_image(images), image)
        assert torch.equal(encoder.encode_text(tokens), text)
        torch.testing.assert_close(image, module.encode_image(images), rtol=0, atol=2e-5)
        torch.testing.assert_close(text, module.encode_text(module.tokenizer(CAPTIONS)), rtol=0, atol=2e-5)
    settings = (teacher.image_size, teacher.image_mean, teacher.image_std)
    assert settings == (encoder.image_size, encoder.image_mean, encoder.image_std)
    assert settings == (module.image_size, tuple(module.image_mean), tuple(module.image_std))


@pytest.mark.parametrize("form", ["open_clip_hf", "hf"])
def test_the_teacher_and_the_encoder_of_one_folder_embed_alike(form, tiny_clip_json, tmp_path):
    module = _clip(tiny_clip_json)
    folder = str(tmp_path / form)
    if form == "hf":
        pytest.importorskip("transformers")
        from mmssl.export.hf import write_hf

        write_hf(module, folder)
    else:
        write_open_clip_hf(module, folder)
    _alike(load_teacher(folder), load_encoder(folder), module)


def _word_tokenizer(folder) -> int:
    """A word-level fast tokenizer saved as a transformers folder; ends each text with </s>."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(str(folder))
    return len(vocab)


def test_an_open_clip_hub_folders_hugging_face_tokenizer_is_read_from_it_or_the_teachers_folder(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    config = json.loads(json.dumps(TINY_CLIP))
    config["text_cfg"].update(vocab_size=_word_tokenizer(tokenizer), hf_tokenizer_name="local/tiny")
    (tmp_path / "tiny_words.json").write_text(json.dumps(config))
    module = _clip(str(tmp_path / "tiny_words.json"), str(tokenizer))
    folder = tmp_path / "oc"
    write_open_clip_hf(module, str(folder))  # mmssl's export writes no tokenizer files
    with pytest.raises(FileNotFoundError, match=f"^{KEY}: the folder .*huggingface-cli download local/tiny"):
        load_teacher(str(folder))
    with pytest.raises(FileNotFoundError, match="huggingface-cli download local/tiny"):
        load_encoder(str(folder))
    teacher = load_teacher(str(folder), tokenizer_dir=str(tokenizer))
    assert torch.equal(teacher.tokenizer(CAPTIONS), module.tokenizer(CAPTIONS))
    # The student's own tokens serve it: the same tokenizer, by the same signature.
    name = resolve_model_name(str(tmp_path / "tiny_words.json"))
    assert teacher.signature == tokenizer_signature(name, str(tokenizer))
    with pytest.raises(ValueError, match="built-in BPE"):  # a BPE config takes no tokenizer folder
        build_folder(str(_bpe_folder(tmp_path)), tokenizer_dir=str(tokenizer))
    for name in tokenizer.iterdir():  # as open_clip's hub folders carry it
        shutil.copy(name, folder / name.name)
    _alike(load_teacher(str(folder)), load_encoder(str(folder)), module)


def _bpe_folder(tmp_path):
    (tmp_path / "bpe.json").write_text(json.dumps(TINY_CLIP))
    write_open_clip_hf(_clip(str(tmp_path / "bpe.json")), str(tmp_path / "bpe"))
    return tmp_path / "bpe"
