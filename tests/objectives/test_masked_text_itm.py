"""The masked-words (``mlm``) and matching (``itm``) objectives in process: what each prepares before
the forward and on which draws, their terms by hand where tests/models/test_clip_mlm.py leaves them,
when they count, what they log, what they refuse at start-up, and a combination CLIPMLM refused
before (distillation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmssl.errors import ConfigError
from mmssl.models.clip import CLIP
from mmssl.models.clip_mlm import CLIPMLM
from mmssl.models.masking import sample_noise
from mmssl.objectives import OBJECTIVES, ImageTextMatching, MaskedLanguageModelling, sample_uniforms
from tests.models.test_clip_mlm import CAPTIONS, _json
from tests.models.test_distill import save_lightning


@pytest.fixture(scope="module")
def micro_json(tmp_path_factory) -> str:
    """tests/models/test_clip_mlm.py's micro CLIPMLM: a bidirectional text tower of width 32."""
    return _json(tmp_path_factory.mktemp("models"))


def _model(micro_json: str, **kwargs) -> CLIPMLM:
    torch.manual_seed(0)
    return CLIPMLM(model_name=micro_json, warmup_steps=0, **kwargs)


def _batch(model: CLIPMLM, seed: int = 1) -> dict[str, torch.Tensor]:
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return {"image": images, "text": model.tokenizer(CAPTIONS)}


def test_the_terms_and_their_draws_come_in_one_order():
    """contrastive + mlm + itm (CLIPMLM's sum); masking's draws before the negatives'."""
    assert [n for n in OBJECTIVES if n in ("contrastive", "caption", "mlm", "itm")] == \
        ["contrastive", "caption", "mlm", "itm"]


def test_training_cuts_one_per_sample_stream_masking_first(micro_json):
    model = _model(micro_json).train()
    batch = _batch(model)
    length = batch["text"].shape[1]
    with torch.no_grad():
        out, prepared = model.step_forward(batch, training=True)
    # Step 0, seed 0, rank 0: one row per sample of 3L masking uniforms then 2N negatives' (N = 4).
    stream = sample_uniforms(0, 0, 0, 4, 3 * length + 8, torch.device("cpu"))
    masking = model.mask_captions(batch["text"], stream[:, :3 * length].reshape(4, length, 3))
    assert torch.equal(prepared["masked_tokens"], masking.input_ids)
    assert torch.equal(prepared["mlm_labels"], masking.labels) and torch.equal(prepared["mlm_selected"],
                                                                               masking.selected)
    assert torch.equal(prepared["itm_uniforms"], stream[:, 3 * length:])
    assert out["masked_states"].shape == (4, length, 32) and set(batch) == {"image", "text"}  # not changed


def test_validation_draws_from_pixels_and_no_negatives(micro_json):
    model = _model(micro_json).eval()
    batch = _batch(model)
    length = batch["text"].shape[1]
    with torch.no_grad():
        _, prepared = model.step_forward(batch, training=False)
        _, alone = model.step_forward({k: v[2:3] for k, v in batch.items()}, training=False)
    noise = sample_noise(batch["image"], 3 * length, seed=1).view(4, length, 3)
    assert torch.equal(prepared["masked_tokens"], model.mask_captions(batch["text"], noise).input_ids)
    assert "itm_uniforms" not in prepared  # validation's negatives are the hardest of the batch
    assert torch.equal(alone["masked_tokens"][0], prepared["masked_tokens"][2])  # whichever batch it is in


def test_validation_terms_by_hand(micro_json):
    """val/mlm_loss is the token mean over the set, val/itm_loss the pair mean; val/loss weights them."""
    model = _model(micro_json, mlm_weight=0.5, itm_weight=2.0).eval()
    batch = _batch(model)
    seen = {}
    model.validation.update = lambda image, text, loss: seen.setdefault("loss", loss)
    with torch.no_grad():
        model.validation_step(batch, 0)
        out, prepared = model.step_forward(batch, training=False)
        selected = prepared["mlm_selected"]
        states = model.forward_text_tokens(prepared["masked_tokens"])[selected]  # (M, W)
        head = model.mlm_head
        logits = head.norm(F.gelu(head.dense(states))) @ model.model.token_embedding.weight.T + head.bias
        mlm = F.cross_entropy(logits, prepared["mlm_labels"][selected])  # the mean over the chosen tokens
        contrastive = model.objectives["contrastive"].val_loss.compute()
    mlm_objective, itm_objective = model.objectives["mlm"], model.objectives["itm"]
    assert mlm_objective.val_loss.compute() == pytest.approx(float(mlm), rel=1e-5)
    itm = itm_objective.val_loss.compute()
    assert seen["loss"] == pytest.approx(float(contrastive + 0.5 * mlm + 2.0 * itm), rel=1e-5)
    top1 = (logits.argmax(-1) == prepared["mlm_labels"][selected]).float().mean()
    assert mlm_objective.val_top1.compute() == pytest.approx(float(top1))


def test_a_late_start_weighs_the_term_zero_and_keeps_the_draws(micro_json):
    early = _model(micro_json, objectives={"mlm": {"start": 2}, "itm": {"start": 1}}).train()
    now = _model(micro_json).train()
    batch = _batch(now)
    terms_early, terms_now = early.losses(batch["image"], batch["text"]), now.losses(batch["image"], batch["text"])
    assert terms_early[1] == 0 and terms_early[2] == 0 and terms_now[1] > 0 and terms_now[2] > 0
    assert early.objectives["mlm"].figures["mlm_top1"] == now.objectives["mlm"].figures["mlm_top1"]
    assert early.hparams["objectives"] == {"mlm": {"start": 2}, "itm": {"start": 1}}  # what was asked


def test_training_logs_each_weighted_term_and_the_figures(micro_json):
    model = _model(micro_json, mlm_weight=0.25).train()
    logged = {}
    model.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    loss = model.training_step(_batch(model), 0)
    assert {"train/loss", "train/contrastive_loss", "train/mlm_loss", "train/itm_loss", "train/mlm_top1",
            "train/itm_accuracy", "train/captions_without_target", "train/logit_scale",
            "train/image_mask_ratio"} <= logged.keys()
    terms = [logged[f"train/{n}_loss"] for n in ("contrastive", "mlm", "itm")]
    assert loss.item() == pytest.approx(sum(terms).item(), rel=1e-6)
    assert logged["train/captions_without_target"] == 0 and 0 <= logged["train/itm_accuracy"] <= 1


def test_an_objective_without_its_parts_is_refused_naming_them(tiny_clip_json):
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.mlm: needs the model part\(s\) "
                                          r"\['mlm_head', 'mask_captions', \"forward input 'masked_tokens'\"\]"):
        CLIP(tiny_clip_json, objectives={"mlm": {}})
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.itm: needs the model part\(s\) "
                                          r"\['itm_head'\], which .* \(CLIP\) does not have"):
        CLIP(tiny_clip_json, objectives={"itm": {"weight": 2.0}})
    assert list(CLIP(tiny_clip_json, objectives={"itm": {"weight": 0.0}})._present()) == ["contrastive"]


def test_bad_options_and_gradcache_are_refused_by_their_keys(micro_json):
    for options, key in (({"mask_ratio": 1.0}, "mask_ratio"), ({"mask_share": 1.5}, "mask_share"),
                         ({"random_share": 0.3}, "random_share"), ({"weight": -1.0}, "weight")):
        with pytest.raises(ConfigError, match=rf"^model.init_args.objectives.mlm.{key}"):
            MaskedLanguageModelling(**options)
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.itm.start"):
        ImageTextMatching(start=1.5)
    with pytest.raises(ConfigError, match=r"^model.init_args.contrastive_chunk_size: the objective\(s\) "
                                          r"\['mlm', 'itm'\] read the whole batch"):
        CLIPMLM(model_name=micro_json, contrastive_chunk_size=2)


def test_a_clip_mlm_distilled_from_a_clip_teacher_trains_every_term(tmp_path, micro_json, tiny_clip_json):
    """CLIPMLM refused distillation while it had its own step; CLIP's step adds the teacher's terms."""
    torch.manual_seed(3)
    teacher = save_lightning(CLIP(tiny_clip_json), tmp_path / "teacher.ckpt")
    student = _model(micro_json, distill={"teacher": str(teacher)}).train()
    batch = _batch(student)
    if student.teacher_text_tokenizer is not None:
        batch["teacher_tokens"] = student.teacher_text_tokenizer(CAPTIONS)
    logged = {}
    student.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    loss = student.training_step(batch, 0)
    loss.backward()
    want = sum(logged[f"train/{n}_loss"] for n in ("contrastive", "logits", "mlm", "itm"))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6) and logged["train/logits_loss"] > 0
    trained = {n.split(".")[0] for n, p in student.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"model", "mlm_head", "itm_head"} <= trained
    assert not any("teacher" in k for k in student.state_dict())
