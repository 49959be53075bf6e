"""mmssl.objectives in process: when a term counts (a step or a fraction of the run), the order of
the terms whatever the config's, every bad option refused by its key, and a combination no class
held before (CoCa distilled from a CLIP teacher) training each of its terms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmssl.errors import ConfigError
from mmssl.models.clip import CLIP
from mmssl.models.coca import CoCa
from mmssl.models.mae import MAEDecoder
from mmssl.objectives import OBJECTIVES, Captioning, Contrastive, build_objectives
from mmssl.objectives.base import PARTS, build_part, register_part
from tests.models.test_distill import save_lightning

CAPTIONS = ["a red circle", "a blue square on a green field", "a star", "two crosses"]


def test_a_start_is_a_step_or_a_fraction_of_the_run():
    at_step = Captioning(weight=2.0, start=3)
    assert [at_step.weight_at(s, 100) for s in (0, 2, 3, 99)] == [0.0, 0.0, 2.0, 2.0]
    late = Captioning(weight=1.5, start=0.8)  # SigLIP 2's last 20%
    assert late.first_step(10) == 8 and late.first_step(7) == 6  # ceil(0.8 x 7 = 5.6): no earlier than 80%
    assert [late.weight_at(s, 10) for s in (7, 8, 9)] == [0.0, 1.5, 1.5]
    assert Contrastive().weight_at(0, 0) == 1.0  # from the first step by default
    for bad in (-1, 1.0, 1.5, -0.1, float("nan"), True, "late"):
        with pytest.raises(ConfigError, match=r"^model.init_args.objectives.caption.start: a step \(an integer >= 0\) "
                                              r"or a fraction of the run in \[0, 1\), got "):
            Captioning(start=bad)
    for bad in (-1.0, float("inf"), float("nan"), None):
        with pytest.raises(ConfigError, match=r"^model.init_args.objectives.contrastive.weight: a number >= 0, got "):
            Contrastive(weight=bad)


def test_terms_are_summed_in_one_order_whatever_the_configs():
    built = build_objectives({"caption": {"weight": 0.5}, "contrastive": None}, {"contrastive": {"loss": "siglip"}})
    assert list(built) == ["contrastive", "caption"] == list(OBJECTIVES)[:2]
    assert (built["contrastive"].loss, built["contrastive"].weight, built["caption"].weight) == ("siglip", 1.0, 0.5)
    assert list(build_objectives({}, {"contrastive": {}})) == ["contrastive"]
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives: a mapping of objective names"):
        build_objectives(["caption"], {})
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.caption: a mapping of its options"):
        build_objectives({"caption": 2.0}, {})


def test_a_coca_distilled_from_a_clip_teacher_trains_every_term(tmp_path, tiny_clip_json, tiny_coca_json):
    """Distillation was CLIP's only (CoCa refused it): now the teacher's terms join the caption term."""
    torch.manual_seed(3)
    teacher = save_lightning(CLIP(tiny_clip_json), tmp_path / "teacher.ckpt")
    torch.manual_seed(0)
    student = CoCa(tiny_coca_json, warmup_steps=0, distill={"teacher": str(teacher)}).train()
    images = torch.randn(len(CAPTIONS), 3, 32, 32, generator=torch.Generator().manual_seed(1))
    batch = {"image": images, "text": student.tokenizer(CAPTIONS)}
    if student.teacher_text_tokenizer is not None:
        batch["teacher_tokens"] = student.teacher_text_tokenizer(CAPTIONS)
    logged = {}
    student.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    torch.manual_seed(5)
    loss = student.training_step(batch, 0)
    loss.backward()
    assert {"train/contrastive_loss", "train/caption_loss", "train/logits_loss"} <= logged.keys()
    want = logged["train/contrastive_loss"] + logged["train/logits_loss"] + logged["train/caption_loss"]
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)  # distill's weights 1, 1; caption's 2 inside its term
    assert logged["train/caption_loss"].item() > 0 and logged["train/logits_loss"].item() > 0
    grads = {n for n, p in student.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(n.startswith("model.text_decoder.") for n in grads) and any(n.startswith("model.visual.") for n in grads)
    assert not any("teacher" in k for k in student.state_dict())


def test_an_objective_without_its_terms_fails_when_built():
    from mmssl.objectives import Objective

    class Half(Objective):
        name = "half"

        def forward(self, out, batch, weight):
            return weight * out["x"]

    with pytest.raises(TypeError, match="abstract method 'validation'|abstract methods? .*validation"):
        Half()


def test_a_part_is_built_by_its_registered_name_and_its_refusal_names_the_key(monkeypatch):
    """Objectives build a model part (MAE's decoder) by the name a model registered it under; a size
    the part refuses is a one-line ConfigError naming the objective's key, an unknown name lists the
    registered ones."""
    assert PARTS["mae_decoder"] is MAEDecoder
    decoder = build_part("mae_decoder", "k", num_patches=4, patch_size=2, encoder_dim=8, embed_dim=8, depth=1,
                         num_heads=2)
    assert isinstance(decoder, MAEDecoder) and decoder.pred.out_features == 2 * 2 * 3
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.x: decoder_embed_dim \(8\) must be "
                                          r"divisible by decoder_num_heads \(3\)$"):
        build_part("mae_decoder", "model.init_args.objectives.x", num_patches=4, patch_size=2, encoder_dim=8,
                   embed_dim=8, depth=1, num_heads=3)
    with pytest.raises(RuntimeError, match=r"k: no model part 'nothing' is registered .*'mae_decoder'"):
        build_part("nothing", "k")
    monkeypatch.setitem(PARTS, "_probe", None)
    register_part("_probe")(nn.Identity)
    assert isinstance(build_part("_probe", "k"), nn.Identity)
