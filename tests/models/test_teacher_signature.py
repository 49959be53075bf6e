"""The teacher's tokenizer signature (mmssl.models.teacher): equal signatures let the student's token
ids serve the teacher (the loader tokenises once), so two text configs get equal signatures exactly
when they tokenise every caption alike, whatever the spelling of their settings."""

from __future__ import annotations

import os

from mmssl.models.teacher import _text_signature


def test_signatures_are_equal_for_configs_that_tokenise_alike():
    assert _text_signature({}, None) == _text_signature({"context_length": 77}, None)  # open_clip's default
    assert _text_signature({"tokenizer_kwargs": {"a": 1, "b": 2}}, None) == \
        _text_signature({"tokenizer_kwargs": {"b": 2, "a": 1}}, None)  # keyword order is not a setting
    hf = {"hf_tokenizer_name": "bert-base-uncased"}
    assert _text_signature(hf, "tok") == _text_signature(hf, os.path.abspath("tok"))  # one folder, two spellings
    assert _text_signature({}, "tok") == _text_signature({}, "other")  # the folder is read by HF tokenizers only


def test_signatures_differ_for_each_setting_that_changes_the_ids():
    base = _text_signature({}, None)
    for changed in ({"context_length": 64}, {"hf_tokenizer_name": "bert-base-uncased"},
                    {"tokenizer_kwargs": {"clean": "canonicalize"}}):
        assert _text_signature(changed, None) != base, changed
    hf = {"hf_tokenizer_name": "bert-base-uncased"}
    assert _text_signature(hf, "tok") != _text_signature(hf, "other")  # two local HF tokenizers
    assert _text_signature(hf, "tok") != _text_signature({"hf_tokenizer_name": "roberta-base"}, "tok")
