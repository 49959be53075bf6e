"""Every evaluation callback picks its set by one rule: its own setting, else the data module's
``eval_data``, else its ``val_data``; only a non-empty string counts as a set."""

from __future__ import annotations

import types

import pytest

from mmssl.callbacks.captions import CaptionNaming
from mmssl.callbacks.health import EmbeddingHealth
from mmssl.callbacks.projector import EmbeddingProjector
from mmssl.callbacks.zero_shot import ZeroShot
from mmssl.evaluation.online import default_data, evaluation_set


def _dm(**sets):
    """A data module as the callbacks see it: only the attributes given exist."""
    return types.SimpleNamespace(**sets)


MIXTURE = [{"urls": "a/{0..1}.tar", "weight": 1.0}, {"urls": "b/{0..1}.tar", "weight": 2.0}]


@pytest.mark.parametrize("dm, own, expected", [
    (_dm(eval_data="E", val_data="V"), None, ("E", "data.eval_data")),  # the labelled held-out set wins
    (_dm(eval_data="E", val_data="V"), "O", ("O", "init_args.data")),  # the callback's own wins over both
    (_dm(eval_data=None, val_data="V"), None, ("V", "data.val_data")),
    (_dm(eval_data="", val_data="V"), None, ("V", "data.val_data")),
    (_dm(val_data="V"), None, ("V", "data.val_data")),  # a data module without eval_data
    (_dm(eval_data="E", val_data=MIXTURE), None, ("E", "data.eval_data")),
    (_dm(eval_data=None, val_data=MIXTURE), None, None),  # a weighted mixture is no one set
    (_dm(eval_data=None, val_data={"urls": "a.tar"}), None, None),
    (_dm(eval_data=None, val_data=None), None, None),
    (None, None, None),  # no data module at all
    (None, "O", ("O", "init_args.data")),
])
def test_precedence_and_guard(dm, own, expected):
    assert evaluation_set(dm, own) == expected


def test_own_key_names_the_setting():
    assert evaluation_set(_dm(eval_data="E"), "O", "init_args.val_data") == ("O", "init_args.val_data")


def _trainer(dm):
    return types.SimpleNamespace(datamodule=dm)


CALLBACKS = [
    lambda data: ZeroShot(data=data),
    lambda data: CaptionNaming(data=data),
    lambda data: EmbeddingProjector(data=data),
    lambda data: EmbeddingHealth(data=data),
]


def _picked(callback, dm):
    found = callback._data(_trainer(dm))
    return found[0] if isinstance(found, tuple) else found


@pytest.mark.parametrize("make", CALLBACKS)
def test_every_callback_follows_the_rule(make):
    assert _picked(make(None), _dm(eval_data="E", val_data="V")) == "E"
    assert _picked(make(None), _dm(eval_data=None, val_data="V")) == "V"
    assert _picked(make("O"), _dm(eval_data="E", val_data="V")) == "O"


@pytest.mark.parametrize("make", CALLBACKS[:3])
def test_labelled_callbacks_refuse_a_mixture(make):
    with pytest.raises(ValueError, match="offers none"):
        make(None)._data(_trainer(_dm(eval_data=None, val_data=MIXTURE)))


def test_health_without_a_set_is_off():
    assert EmbeddingHealth()._data(_trainer(_dm(eval_data=None, val_data=MIXTURE))) is None


def test_probes_follow_the_rule():
    dm = _dm(train_data="T", eval_data="E", val_data="V")
    assert default_data(_trainer(dm), None, None, "LinearProbe") == ("T", "E")
    assert default_data(_trainer(dm), "t", "v", "LinearProbe") == ("t", "v")
    assert default_data(_trainer(_dm(train_data="T", val_data="V")), None, None, "KNNProbe") == ("T", "V")
    with pytest.raises(ValueError, match="KNNProbe: the data module offers no labelled"):
        default_data(_trainer(_dm(train_data="T", eval_data=None, val_data=MIXTURE)), None, None, "KNNProbe")
