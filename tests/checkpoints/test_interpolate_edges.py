"""The edges of mmssl.checkpoints.interpolate (WiSE-FT's weight mixing) that
tests/checkpoints/test_wise_ft.py leaves open: the alphas' ends and messages, the first mismatch
named (keys on either side with their count, shapes, floating against integer), low-precision
weights mixed in float32 and returned in the end's dtype, integer tensors copied, every
architecture hyper-parameter compared (a model config by content), and the mixed checkpoint's
entries."""

from __future__ import annotations

import json

import pytest
import torch

from mmssl.checkpoints.interpolate import (
    ARCHITECTURE_KEYS,
    DEFAULT_ALPHAS,
    architecture_mismatch,
    check_alphas,
    first_mismatch,
    interpolate_checkpoints,
    interpolate_state,
)

CLIP_PATH = "mmssl.models.clip.CLIP"


def test_alphas_are_floats_from_zero_to_one_inclusive_and_refused_with_their_value():
    assert check_alphas([0, 1, "0.5", 0.25]) == [0.0, 1.0, 0.5, 0.25]
    assert DEFAULT_ALPHAS == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    for bad in (1.0000001, -1e-9, float("nan")):
        with pytest.raises(ValueError) as info:
            check_alphas([0.5, bad])
        assert str(info.value) == f"alpha {bad!r} is outside [0, 1] (0 = the start checkpoint, 1 = the fine-tuned end)"
    with pytest.raises(ValueError) as info:
        check_alphas([])
    assert str(info.value) == "no alpha given"


def test_the_first_mismatch_is_named_with_how_many_keys_differ():
    a = {"w": torch.zeros(2), "x": torch.zeros(1), "y": torch.zeros(1)}
    assert first_mismatch(a, dict(a)) is None
    assert first_mismatch(a, {"w": torch.zeros(2)}) == "key 'x' is in the start checkpoint only (2 such keys)"
    assert first_mismatch({"w": torch.zeros(2)}, a) == "key 'x' is in the end checkpoint only (2 such keys)"
    # Keys on both sides: the start's named first.
    assert first_mismatch({"w": torch.zeros(2), "s": torch.zeros(1)}, {"w": torch.zeros(2), "e": torch.zeros(1)}) \
        == "key 's' is in the start checkpoint only (1 such keys)"
    shapes = {"a": torch.zeros(2, 3), "b": torch.zeros(1)}, {"a": torch.zeros(3, 2), "b": torch.zeros(2)}
    assert first_mismatch(*shapes) == "key 'a' has shape (2, 3) in the start and (3, 2) in the end"
    assert first_mismatch({"n": torch.zeros(2), "m": torch.zeros(1)}, {"n": torch.zeros(2, dtype=torch.long),
                                                                       "m": torch.zeros(1, dtype=torch.int32)}) \
        == "key 'm' is torch.float32 in the start and torch.int32 in the end"
    assert first_mismatch({"h": torch.zeros(2, dtype=torch.float16)}, {"h": torch.zeros(2)}) is None  # both floats


def test_low_precision_weights_are_mixed_in_float32_in_the_ends_dtype_and_integers_copied():
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(64, generator=g).to(torch.bfloat16), "f": torch.randn(4, generator=g),
             "n": torch.tensor([3, 4])}
    end = {"w": torch.randn(64, generator=g).to(torch.bfloat16), "f": torch.randn(4, generator=g).half(),
           "n": torch.tensor([7, 8])}
    mixed = interpolate_state(start, end, 0.3)
    want = (0.7 * start["w"].float() + 0.3 * end["w"].float()).to(torch.bfloat16)
    assert mixed["w"].dtype == torch.bfloat16 and torch.equal(mixed["w"], want)
    assert mixed["f"].dtype == torch.float16  # the end's dtype
    torch.testing.assert_close(mixed["f"], (0.7 * start["f"] + 0.3 * end["f"].float()).half())
    for alpha, want_n in ((1e-6, [7, 8]), (0.0, [3, 4])):
        n = interpolate_state(start, end, alpha)["n"]
        assert n.tolist() == want_n
        n += 1  # a copy: neither input changes
    assert start["n"].tolist() == [3, 4] and end["n"].tolist() == [7, 8]
    with pytest.raises(ValueError) as info:
        interpolate_state(start, {**end, "n": torch.tensor([7])}, 0.5)
    assert str(info.value) == "the checkpoints cannot be interpolated: key 'n' has shape (2,) in the start and (1,) " \
                              "in the end"
    with pytest.raises(ValueError, match=r"^alpha 2 is outside \[0, 1\]"):
        interpolate_state(start, end, 2)


def _ckpt(state: dict, **hparams) -> dict:
    return {"state_dict": state, "hyper_parameters": {"_class_path": CLIP_PATH, **hparams}}


def test_every_architecture_hyper_parameter_is_compared_and_a_config_file_by_its_content(tmp_path):
    state = {"w": torch.zeros(2)}
    assert "embed_dim" in ARCHITECTURE_KEYS and "decoder_depth" in ARCHITECTURE_KEYS
    for key in ARCHITECTURE_KEYS:
        if key == "model_name":
            continue
        assert architecture_mismatch(_ckpt(state, **{key: 1}), _ckpt(state, **{key: 2})) == (
            f"hyper-parameter {key!r} is 1 in the start and 2 in the end")
    assert architecture_mismatch(_ckpt(state, lr=1e-3), _ckpt(state, lr=1e-5)) is None  # not architecture
    config = {"embed_dim": 8, "vision_cfg": {"width": 16}}
    for name in ("a.json", "b.json", "c.json"):
        (tmp_path / name).write_text(json.dumps(config if name != "c.json" else {**config, "embed_dim": 4}))
    a, b, c = (str(tmp_path / n) for n in ("a.json", "b.json", "c.json"))
    assert architecture_mismatch(_ckpt(state, model_name=a), _ckpt(state, model_name=b)) is None  # the same content
    assert architecture_mismatch(_ckpt(state, model_name=a), _ckpt(state, model_name=c)) == (
        f"hyper-parameter 'model_name' is {a!r} in the start and {c!r} in the end")
    missing = str(tmp_path / "gone.json")
    assert architecture_mismatch(_ckpt(state, model_name=a), _ckpt(state, model_name=missing)).startswith(
        "hyper-parameter 'model_name'")
    assert architecture_mismatch(_ckpt(state), {"state_dict": {"v": torch.zeros(1)}}, kinds=("CLIP", "CLIP")) == (
        "key 'w' is in the start checkpoint only (1 such keys)")  # kinds given: no hyper-parameters needed
    assert architecture_mismatch(_ckpt(state), {"state_dict": state, "hyper_parameters": {"_class_path": "my.Net"}}) \
        == "the start is a CLIP checkpoint and the end a my.Net one"


def test_the_mixed_checkpoint_holds_the_ends_hyper_parameters_and_the_mix(tmp_path):
    start = _ckpt({"w": torch.zeros(2)}, lr=1.0)
    end = _ckpt({"w": torch.ones(2)}, lr=2.0)
    mixed = interpolate_checkpoints(start, end, 0.75, names=("s.ckpt", "e.ckpt"))
    assert set(mixed) == {"state_dict", "hyper_parameters", "wise_ft"}
    assert mixed["wise_ft"] == {"alpha": 0.75, "start": "s.ckpt", "end": "e.ckpt"}
    assert mixed["hyper_parameters"] == end["hyper_parameters"] and mixed["state_dict"]["w"].tolist() == [0.75] * 2
    mixed["hyper_parameters"]["lr"] = 0.0  # a copy
    assert end["hyper_parameters"]["lr"] == 2.0
    assert interpolate_checkpoints(start, {"state_dict": end["state_dict"]}, 0.5, kinds=("CLIP", "CLIP"))[
        "hyper_parameters"] == {}
    with pytest.raises(ValueError) as info:
        interpolate_checkpoints(start, _ckpt({"w": torch.ones(3)}), 0.5, names=("s.ckpt", "e.ckpt"))
    assert str(info.value) == ("s.ckpt and e.ckpt cannot be interpolated: key 'w' has shape (2,) in the start and "
                               "(3,) in the end")


def test_checkpoints_that_record_no_class_are_told_apart_by_their_runs_config(tmp_path):
    names = []
    for run, class_path in (("a", CLIP_PATH), ("b", "mmssl.models.classifier.ImageClassifier"), ("c", "my.Net")):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        (tmp_path / run / "config.yaml").write_text(f"model:\n  class_path: {class_path}\n")
        names.append(str(tmp_path / run / "checkpoints" / "last.ckpt"))
    bare = {"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {}}
    assert architecture_mismatch(bare, bare, names=names) == (
        "the start is a CLIP checkpoint and the end a ImageClassifier one")
    assert architecture_mismatch(bare, bare, names=[names[0], names[0]]) is None
    assert architecture_mismatch(bare, bare, names=[names[0], names[2]]) == (  # a class outside mmssl's table
        "the start is a CLIP checkpoint and the end a my.Net one")
