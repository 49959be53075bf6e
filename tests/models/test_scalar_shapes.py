"""open_clip's 0-d ``logit_scale`` / ``logit_bias``: (1,) for sharding, 0-d in every whole checkpoint.

A sharded run reshapes the scalars to (1,) (FSDP refuses 0-d parameters); the checkpoints it
writes whole, and the checkpoints it loads, keep open_clip's 0-d shape, so a file trained sharded
loads into open_clip and into an unsharded run, and the other way round (mmssl.models.scalars).
"""

from __future__ import annotations

import os

import pytest
import torch

from mmssl.checkpoints.read import SCALAR_KEYS
from mmssl.models.clip import CLIP
from mmssl.models.scalars import _to_open_clip_shape, record_scalar_keys, scalars_as_vectors

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "clip_micro.json")
KEYS = ("model.logit_scale", "model.logit_bias")


@pytest.fixture(scope="module")
def siglip() -> CLIP:
    torch.manual_seed(0)
    return CLIP(CONFIG, loss="siglip")  # has both scalars (SigLIP's bias)


def test_vectors_keep_values_gradient_flags_and_leave_vectors_alone():
    model = torch.nn.Module()
    model.logit_scale = torch.nn.Parameter(torch.tensor(2.5))
    model.logit_bias = torch.nn.Parameter(torch.tensor(-7.0), requires_grad=False)  # a frozen bias stays frozen
    scalars_as_vectors(model)
    for key, value, grad in (("logit_scale", 2.5, True), ("logit_bias", -7.0, False)):
        param = getattr(model, key)
        assert isinstance(param, torch.nn.Parameter) and param.shape == (1,)
        assert param.item() == value and param.requires_grad is grad
    already = model.logit_scale
    scalars_as_vectors(model)  # a second call (configure_model runs again on resume) changes nothing
    assert model.logit_scale is already

    plain = torch.nn.Module()  # a model without the scalars, or with a plain tensor, is left as it is
    plain.logit_bias = None
    plain.register_buffer("logit_scale", torch.tensor(1.0))
    scalars_as_vectors(plain)
    assert plain.logit_bias is None and plain.logit_scale.shape == ()


def test_a_sharded_runs_whole_checkpoint_keeps_open_clips_0d_scalars_and_loads_either_way(siglip):
    reference = {k: v.clone() for k, v in siglip.state_dict().items()}
    torch.manual_seed(0)
    vectors = CLIP(CONFIG, loss="siglip")
    vectors.scalars_as_vectors()
    assert all(vectors.model.get_parameter(k.split(".", 1)[1]).shape == (1,) for k in KEYS)

    saved = vectors.state_dict()
    for key in KEYS:
        assert saved[key].shape == () and torch.equal(saved[key], reference[key])

    wrapper = torch.nn.Module()  # the hooks act under a prefix too (a module held by another)
    wrapper.clip = vectors
    nested = wrapper.state_dict()
    assert all(nested[f"clip.{k}"].shape == () for k in KEYS)

    # (1,) scalars (a sharded checkpoint's) load into a whole model, 0-d ones into a sharded one.
    torch.manual_seed(1)
    whole = CLIP(CONFIG, loss="siglip")
    whole.load_state_dict({k: (v.reshape(1) if k in KEYS else v) for k, v in reference.items()}, strict=True)
    assert all(whole.state_dict()[k].shape == () and torch.equal(whole.state_dict()[k], reference[k]) for k in KEYS)
    torch.manual_seed(1)
    sharded = CLIP(CONFIG, loss="siglip")
    sharded.scalars_as_vectors()
    other = torch.nn.Module()
    other.clip = sharded
    other.load_state_dict({f"clip.{k}": v for k, v in reference.items()}, strict=True)
    for key in KEYS:
        param = sharded.model.get_parameter(key.split(".", 1)[1])
        assert param.shape == (1,) and param.item() == reference[key].item()


def test_a_model_without_a_bias_saves_and_loads_its_scale_alone():
    torch.manual_seed(0)
    clip = CLIP(CONFIG)  # CLIP's loss: no logit_bias
    assert clip.model.logit_bias is None
    saved = clip.state_dict()
    assert "model.logit_bias" not in saved
    state = {k: v.reshape(1) if k == "model.logit_scale" else v for k, v in saved.items()}
    state["model.logit_bias"] = torch.tensor([3.0])  # an unexpected bias is left for strict loading to refuse
    with pytest.raises(RuntimeError, match="logit_bias"):
        clip.load_state_dict(state, strict=True)
    del state["model.logit_bias"]
    clip.load_state_dict(state, strict=True)
    assert clip.model.logit_scale.shape == ()

    checkpoint: dict = {}
    record_scalar_keys(clip.model, checkpoint)
    assert checkpoint[SCALAR_KEYS] == ["model.logit_scale"]


def test_sharded_checkpoints_name_both_scalars_and_keep_shards_as_they_are(siglip):
    checkpoint: dict = {}
    record_scalar_keys(siglip.model, checkpoint)
    assert checkpoint[SCALAR_KEYS] == list(KEYS)

    shard = torch.tensor([4.0])
    shard.full_tensor = lambda: shard  # an FSDP2 DTensor: cannot be reshaped, stays (1,)
    plain, matrix = torch.tensor([5.0]), torch.ones(2, 2)
    state = {"model.logit_scale": shard, "model.logit_bias": plain, "model.proj": matrix}
    _to_open_clip_shape(siglip, state, "")
    assert state["model.logit_scale"] is shard and state["model.logit_bias"].shape == ()
    assert state["model.proj"] is matrix
