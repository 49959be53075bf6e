"""FLYP's captions from class labels (data.captions_from_classes): each caption is a template of
the sample's class, drawn from the sample's RNG after its crop, so a resumed stream draws the same
captions and the crops are those of a stream without them; bad files are refused naming them."""

from __future__ import annotations

import os
import random

import pytest
import torch

from mmssl.data.captions import ClassCaptions, class_captions
from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.decode import BadSample
from mmssl.data.label_files import read_templates
from mmssl.data.pipeline import worker_batches


def _texts(captions: list[str]) -> list[str]:
    return list(captions)  # a "tokenizer" that keeps the strings, so the test reads them


def _module(tiny_demo, **kwargs) -> ImageTextDataModule:
    return ImageTextDataModule(train_data=tiny_demo.train, batch_size=4, num_workers=0, image_size=16,
                               shuffle_buffer=8, tokenizer=_texts, **kwargs)


def test_captions_name_each_samples_class_resume_exactly_and_keep_the_crops(tiny_demo):
    names = os.path.join(tiny_demo.root, "classnames.txt")
    module = _module(tiny_demo, captions_from_classes=names)
    templates = read_templates(tiny_demo.eval_dir)  # the set's prompts, at its root
    stream = module.build_stream(tiny_demo.train, True)
    full = list(worker_batches(stream.spec, stream.decoder, 0, 0))
    used = set()
    for batch in full:
        for text, label in zip(batch["text"], batch["label"].tolist()):
            matches = [t for t in templates if t.format(c=tiny_demo.classnames[label]) == text]
            assert matches, (text, label)
            used.add(matches[0])
    assert len(used) > 1  # a template drawn per sample, not one for all
    # Resumed after the first batch: the same captions (and images) as the uninterrupted stream.
    resumed = list(worker_batches(stream.spec, stream.decoder, 0, 0, done=1, skip=full[0]["__raw__"]))
    assert [b["text"] for b in resumed] == [b["text"] for b in full[1:]]
    # The template is drawn after the crop: the images are those of the shards' own captions.
    plain = _module(tiny_demo).build_stream(tiny_demo.train, True)
    for a, b in zip(full, worker_batches(plain.spec, plain.decoder, 0, 0)):
        assert torch.equal(a["image"], b["image"]) and a["text"] != b["text"]
    # Another epoch draws other templates for the same samples.
    assert [b["text"] for b in worker_batches(stream.spec, stream.decoder, 1, 0)] != [b["text"] for b in full]


def test_validation_captions_are_fixed_per_sample():
    captions = ClassCaptions(["cat", "dog"], ["a {c}.", "the {c}!", "{c}?"])
    assert {captions.caption(1, None, "k7") for _ in range(5)} == {captions.caption(1, None, "k7")}
    assert captions.caption(0, random.Random(0), "k") in {"a cat.", "the cat!", "cat?"}


def test_a_sample_without_a_class_name_is_a_bad_sample():
    captions = ClassCaptions(["cat", "dog"], ["a {c}."], "names.txt")
    with pytest.raises(BadSample, match="label 2 has no class name \\(2 in names.txt\\)"):
        captions.caption(2, None, "k")
    with pytest.raises(BadSample, match="no class label"):
        captions.caption(None, None, "k")


def test_bad_class_name_and_template_files_are_refused_naming_them(tiny_demo, tmp_path):
    with pytest.raises(FileNotFoundError, match="captions_from_classes=.*no_names.txt"):
        _module(tiny_demo, captions_from_classes=str(tmp_path / "no_names.txt"))
    (tmp_path / "shards").mkdir()
    with pytest.raises(FileNotFoundError, match="has no classnames.txt"):
        class_captions(str(tmp_path / "shards"))  # a set without class names
    (tmp_path / "names.txt").write_text("cat\n\ndog\n")
    with pytest.raises(ValueError, match="names.txt, line 2: blank line"):
        class_captions(str(tmp_path / "names.txt"))
    (tmp_path / "names.txt").write_text("cat\ndog\n")
    (tmp_path / "t.txt").write_text("a photo\n")
    with pytest.raises(ValueError, match=r"t.txt, line 1: 'a photo' has no '\{c\}' placeholder"):
        class_captions(str(tmp_path / "names.txt"), str(tmp_path / "t.txt"))
    # A template format() cannot fill with the class name alone fails here, not at the first prompt.
    cases = (("a {c}\n\na {c} {d} photo\n", r"line 3: 'a \{c\} \{d\} photo' cannot be filled .*KeyError: 'd'"),
             ("a {c} in {\n", r"line 1: .* cannot be filled .*ValueError"),
             ("\n\n", r"t.txt: no templates"))
    for text, problem in cases:
        (tmp_path / "t.txt").write_text(text)
        with pytest.raises(ValueError, match=problem):
            class_captions(str(tmp_path / "names.txt"), str(tmp_path / "t.txt"))
    (tmp_path / "t.txt").write_text("a photo")
    with pytest.raises(ValueError, match="caption_templates is set without"):
        _module(tiny_demo, caption_templates=str(tmp_path / "t.txt"))
    # No templates file beside the names: CLIP's 80 ImageNet prompts (FLYP's ImageNet recipe).
    assert len(class_captions(str(tmp_path / "names.txt")).templates) == 80
