"""The checkpoint reader's branches each by exact outcome: a .safetensors file, a file that is no
dict, the refusal naming every offending global, and which weights a Lightning checkpoint with
and without an EMA hands back (``tests/checkpoints/test_checkpoints.py`` and ``tests/callbacks/test_ema.py``
cover the files mmssl fit writes)."""

from __future__ import annotations

import argparse
import fractions

import pytest
import torch

from mmssl.checkpoints.read import (
    AVERAGING_STATE,
    RAW_WEIGHTS,
    UnsafeCheckpointError,
    has_averaged_weights,
    lightning_weights,
    read_checkpoint,
    read_state_dict,
)


def test_a_safetensors_file_is_read_by_its_extension(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.arange(3.0)}, str(path))
    assert read_checkpoint(str(path))["w"].tolist() == [0.0, 1.0, 2.0]
    assert read_state_dict(str(path))["w"].tolist() == [0.0, 1.0, 2.0]


def test_a_file_that_is_no_dict_and_one_pickling_globals_are_refused_by_name(tmp_path):
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], listed)
    with pytest.raises(ValueError) as err:
        read_checkpoint(str(listed))
    assert str(err.value) == f"{listed}: expected a dict (checkpoint or state dict), found list"
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"args": argparse.Namespace(lr=1), "ratio": fractions.Fraction(1, 3)}, unsafe)
    with pytest.raises(UnsafeCheckpointError) as err:
        read_checkpoint(str(unsafe))
    assert str(err.value) == (
        f"{unsafe}: refused to load: the file pickles argparse.Namespace, fractions.Fraction, which mmssl "
        "does not allow (checkpoints are read with torch.load(weights_only=True); only tensors, containers "
        "and primitives are accepted, as mmssl fit writes them). If the file is yours, re-save its state "
        "dict alone, or as .safetensors.")


def test_which_weights_a_lightning_checkpoint_hands_back(tmp_path):
    averaged, raw = {"w": torch.ones(1)}, {"w": torch.zeros(1)}
    with_ema = {"state_dict": averaged, RAW_WEIGHTS: raw, AVERAGING_STATE: {"n_averaged": 3}}
    assert has_averaged_weights(with_ema)
    assert not has_averaged_weights({"state_dict": averaged, RAW_WEIGHTS: raw})  # no average's state
    assert not has_averaged_weights({"state_dict": averaged, AVERAGING_STATE: {}})  # no raw weights
    assert lightning_weights("x", with_ema) is raw and lightning_weights("x", with_ema, ema=True) is averaged
    plain = {"state_dict": averaged}
    assert lightning_weights("x", plain) is averaged
    with pytest.raises(ValueError) as err:
        lightning_weights("x.ckpt", plain, ema=True)
    assert str(err.value) == ("x.ckpt: --ema asks for averaged weights and this checkpoint holds none (no "
                              "'current_model_state'): it was not trained with mmssl.callbacks.EMA")
    path = tmp_path / "ema.ckpt"
    torch.save({"state_dict": {"module.w": torch.ones(1)}, RAW_WEIGHTS: {"module.w": torch.zeros(1)},
                AVERAGING_STATE: {}}, path)
    assert read_state_dict(str(path))["w"].item() == 0.0 and read_state_dict(str(path), ema=True)["w"].item() == 1.0
    release = tmp_path / "mae_release.pth"
    torch.save({"model": {"w": torch.ones(1)}}, release)
    assert list(read_state_dict(str(release))) == ["w"]
    with pytest.raises(ValueError) as err:
        read_state_dict(str(release), ema=True)
    assert str(err.value) == (f"{release}: --ema reads a Lightning checkpoint's averaged weights; this file is no "
                              "Lightning checkpoint (no 'state_dict')")
