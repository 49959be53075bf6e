"""CoCa (mmssl.models.coca) edges the end-to-end tests leave open, in process: the CLIP options it takes
now that it is CLIP with captioning (SigLIP's loss, the objectives' starts), the refusals left (a
tower whose padding matters, a decoder-less model asked to caption) and the weights' bounds, by their
messages; a Hugging Face text tower not on the machine;
the caption loss's rescale over ranks (two ranks simulated in one process); GradCache chunks with
weights other than 1; what a training and a validation step log; the special ids of both tokenizer
kinds; what ``generate`` passes on and the ``seq_len`` it takes."""

from __future__ import annotations

import copy
import json
import types

import pytest
import torch

import mmssl.models.coca as coca_module
import mmssl.objectives.caption as caption_module
import mmssl.objectives.contrastive as contrastive_module
from mmssl.errors import ConfigError
from mmssl.models.clip import CLIP
from mmssl.models.coca import CoCa, check_text_tower_local
from mmssl.models.open_clip_config import resolve_model_name
from tests.conftest import TINY_COCA

CAPTIONS = ["red", "a star", "blue", "a cross",
            "a large red circle in the top left on white", "a small blue square in the center on black",
            "a drawing of a star in the bottom right", "a picture of a green cross, small, on gray"]


def _model(json_path: str, **kwargs) -> CoCa:
    torch.manual_seed(0)
    return CoCa(json_path, warmup_steps=0, **kwargs).train()


def _batch(model: CoCa) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(len(CAPTIONS), 3, 32, 32, generator=g), model.tokenizer(CAPTIONS)


def test_siglip_with_captioning_is_a_coca_with_siglips_loss(tiny_coca_json):
    """SigLIP 2's pairing (Tschannen et al. 2025, sec. 2.1: the sigmoid loss and a captioning
    decoder): the sigmoid loss with the model's bias, plus the caption term, summed."""
    model = _model(tiny_coca_json, loss="siglip")
    images, tokens = _batch(model)
    assert model.model.logit_bias.item() == -10.0  # SigLIP's initial bias, in open_clip's CoCa
    contrastive, caption = model.losses(images, tokens)
    torch.manual_seed(0)
    out = model(images, tokens)
    want = torch.nn.functional.logsigmoid(
        (2 * torch.eye(8) - 1) * (out["logit_scale"] * out["image_features"] @ out["text_features"].T
                                  + out["logit_bias"])).sum() / -8
    torch.testing.assert_close(contrastive, want)
    assert caption.item() > 0 and contrastive.requires_grad and caption.requires_grad
    same = CLIP(tiny_coca_json, loss="siglip", objectives={"caption": {}}, warmup_steps=0)  # the same from CLIP
    assert list(same.objectives) == ["contrastive", "caption"] and same.objectives["caption"].weight == 2.0


def test_an_option_that_cannot_hold_is_refused_by_its_key(tiny_coca_json):
    with pytest.raises(ValueError, match=r"^model.trim_text_padding: the text tower of .* is not causal"):
        CoCa(tiny_coca_json, trim_text_padding=True)  # the class token sits after the caption
    with pytest.raises(ConfigError) as err:
        CLIP("configs/models/clip_micro.json", objectives={"caption": {"weight": 1.0}})
    assert str(err.value) == ("model.init_args.objectives.caption: needs the model part(s) ['text_decoder'], "
                              "which 'configs/models/clip_micro.json' (CLIP) does not have")
    CLIP("configs/models/clip_micro.json", objectives={"caption": {"weight": 0.0}})  # off: nothing needed
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.captions: no such objective; known: "):
        CoCa(tiny_coca_json, objectives={"captions": {}})
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.caption.start: a step .* got 1.5$"):
        CoCa(tiny_coca_json, objectives={"caption": {"start": 1.5}})
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.caption: .*unexpected keyword .*'wieght'"):
        CoCa(tiny_coca_json, objectives={"caption": {"wieght": 1.0}})
    with pytest.raises(ConfigError, match=r"^model.init_args.objectives.contrastive.loss: set model.init_args.loss"):
        CoCa(tiny_coca_json, objectives={"contrastive": {"loss": "siglip"}})


def test_the_tokenizer_folder_is_built_first_and_a_pretrained_decoder_is_kept(tiny_coca_json, tmp_path,
                                                                               monkeypatch):
    built = []

    def build(name, folder):
        built.append((name, folder))
        raise InterruptedError  # a missing tokenizer is the first error, before any model is built

    monkeypatch.setattr(coca_module, "build_tokenizer", build)
    with pytest.raises(InterruptedError):
        CoCa(tiny_coca_json, tokenizer=str(tmp_path))
    assert built == [("coca_test_tiny", str(tmp_path))]
    monkeypatch.undo()
    trained = _model(tiny_coca_json).model.state_dict()
    torch.save(trained, tmp_path / "coca.pt")
    torch.manual_seed(5)
    loaded = CoCa(tiny_coca_json, pretrained=str(tmp_path / "coca.pt")).model.state_dict()
    key = "text_decoder.text_projection"
    assert torch.equal(loaded[key], trained[key])  # not re-initialised over the file's weights


def test_the_caption_loss_ignores_the_configs_own_padding_id(tmp_path):
    config = copy.deepcopy(TINY_COCA)
    config["pad_id"] = 3
    (tmp_path / "coca_pad3.json").write_text(json.dumps(config))
    model = CoCa(str(tmp_path / "coca_pad3.json"))
    assert model.pad_id == 3 and model.objectives["caption"].pad_id == 3


def test_negative_loss_weights_are_refused_with_both_values(tiny_coca_json):
    for weights in ((-1.0, 1.0), (2.0, -0.5)):
        with pytest.raises(ValueError) as err:
            CoCa(tiny_coca_json, caption_loss_weight=weights[0], clip_loss_weight=weights[1])
        assert str(err.value) == ("model.caption_loss_weight and clip_loss_weight must be >= 0, "
                                  f"got {weights[0]}, {weights[1]}")
    model = CoCa(tiny_coca_json, caption_loss_weight=0.0, clip_loss_weight=0.0)  # 0 is a weight
    assert (model.objectives["caption"].weight, model.objectives["contrastive"].weight) == (0.0, 0.0)
    with pytest.raises(ValueError) as err:
        CoCa("configs/models/clip_micro.json")
    assert str(err.value) == ("model.model_name: 'configs/models/clip_micro.json' is no CoCa config (it has no "
                              "multimodal_cfg); train it with mmssl.models.clip.CLIP")


def test_a_model_carries_its_pad_id_and_runs_its_text_tower_on_the_whole_context(tiny_coca_json):
    model = CoCa(tiny_coca_json)
    assert model.pad_id == 0 and model.objectives["caption"].pad_id == 0 and model.trim_text_padding is False
    assert (model.objectives["caption"].weight, model.objectives["contrastive"].weight) == (2.0, 1.0)  # the paper's


def test_the_default_model_is_open_clips_coca_vit_b_32(monkeypatch):
    named = []

    def resolve(name):
        named.append(name)
        raise InterruptedError  # stop before a ViT-B/32 is built

    monkeypatch.setattr(coca_module, "resolve_model_name", resolve)
    with pytest.raises(InterruptedError):
        CoCa()
    import open_clip

    config = open_clip.get_model_config(named[0])
    assert "multimodal_cfg" in config and config["vision_cfg"]["patch_size"] == 32
    assert config["vision_cfg"]["width"] == 768  # ViT-B


def test_a_hugging_face_text_tower_in_the_local_cache_is_looked_up_offline(tmp_path, monkeypatch):
    import transformers

    looked_up = []
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda name, **kwargs: looked_up.append((name, kwargs)))
    config = copy.deepcopy(TINY_COCA)
    config["text_cfg"]["hf_model_name"] = "org/cached-text-tower"
    (tmp_path / "coca_hf_cached.json").write_text(json.dumps(config))
    assert check_text_tower_local(resolve_model_name(str(tmp_path / "coca_hf_cached.json"))) is None
    assert looked_up == [("org/cached-text-tower", {"local_files_only": True})]


def test_a_hugging_face_text_tower_not_on_this_machine_is_refused_with_the_fetch_command(tmp_path):
    config = copy.deepcopy(TINY_COCA)
    config["text_cfg"]["hf_model_name"] = "org/absent-text-tower"
    (tmp_path / "coca_hf_absent.json").write_text(json.dumps(config))
    name = resolve_model_name(str(tmp_path / "coca_hf_absent.json"))
    with pytest.raises(FileNotFoundError) as err:
        check_text_tower_local(name)
    assert str(err.value) == (
        "model.model_name: 'coca_hf_absent' has the Hugging Face text tower 'org/absent-text-tower' "
        "(text_cfg.hf_model_name), which is not on this machine and mmssl never downloads: fetch it once "
        "(huggingface-cli download org/absent-text-tower --local-dir DIR) and name DIR as text_cfg.hf_model_name "
        "in a JSON model config")
    # A local folder is taken as it is (open_clip reads it), and so is a config without a Hugging Face tower.
    config["text_cfg"]["hf_model_name"] = str(tmp_path)
    (tmp_path / "coca_hf_local.json").write_text(json.dumps(config))
    assert check_text_tower_local(resolve_model_name(str(tmp_path / "coca_hf_local.json"))) is None
    (tmp_path / "coca_plain.json").write_text(json.dumps(TINY_COCA))
    assert check_text_tower_local(resolve_model_name(str(tmp_path / "coca_plain.json"))) is None


def test_two_simulated_ranks_average_to_the_concatenated_batchs_losses(tiny_coca_json, monkeypatch):
    """Rank r sees its 4 samples, the other rank's features gathered and its label tokens all-reduced:
    the mean of the two ranks' (contrastive, caption) is one process's on the 8 samples, though rank 0's
    captions are short and rank 1's long (16 vs 36 label tokens)."""
    model = _model(tiny_coca_json).eval()  # no FLIP: each rank's features are the one process's rows
    images, tokens = _batch(model)
    with torch.no_grad():
        whole = model.losses(images, tokens)
        out = model(images, tokens)
    features = {"image": out["image_features"], "text": out["text_features"]}
    counts = [(tokens[rows, 1:] != model.pad_id).sum() for rows in (slice(0, 4), slice(4, 8))]
    assert counts[0] != counts[1]
    per_rank = []
    for r in (0, 1):
        rows = slice(4 * r, 4 * r + 4)
        calls = []

        def gather(x, same_size=False, r=r, rows=rows, calls=calls):
            kind = ("text", "image")[len(calls)]
            calls.append(kind)
            torch.testing.assert_close(x, features[kind][rows])
            return torch.cat([x if q == r else features[kind][4 * q:4 * q + 4] for q in (0, 1)])

        def all_reduce(total, r=r):
            total.copy_(counts[0] + counts[1])

        monkeypatch.setattr(contrastive_module, "gather_with_grad", gather)
        monkeypatch.setattr(caption_module, "is_distributed", lambda: True)
        monkeypatch.setattr(contrastive_module, "rank", lambda r=r: r)
        monkeypatch.setattr(caption_module, "world_size", lambda: 2)
        monkeypatch.setattr(caption_module.dist, "all_reduce", all_reduce)
        with torch.no_grad():
            per_rank.append(torch.stack(model.losses(images[rows], tokens[rows])))
        assert calls == ["text", "image"]
    torch.testing.assert_close(sum(per_rank) / 2, torch.stack(whole), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip_weight", [0.5, 0.0])
def test_gradcache_chunks_apply_both_weights(tiny_coca_json, clip_weight):
    results = []
    for chunk in (None, 3):
        model = _model(tiny_coca_json, caption_loss_weight=3.0, clip_loss_weight=clip_weight,
                       contrastive_chunk_size=chunk)
        results.append([x.item() for x in model.losses(*_batch(model))])
    assert results[1] == pytest.approx(results[0], rel=1e-5)
    assert (results[1][0] == 0.0) == (clip_weight == 0.0)
    chunks = []
    chunk_of = model._joint_chunk
    model._joint_chunk = lambda images, tokens: chunks.append(len(images)) or chunk_of(images, tokens)
    model.losses(*_batch(model))
    assert chunks == [3, 3, 2]  # the batch embedded and decoded 3 samples at a time
    chunks.clear()
    model.eval()
    model.losses(*_batch(model))  # validation: one forward
    model = _model(tiny_coca_json, contrastive_chunk_size=8)  # a chunk as large as the batch: one forward
    model._joint_chunk = lambda *a: chunks.append(a)
    model.losses(*_batch(model))
    assert chunks == []


class _Logged:
    def __init__(self, model: CoCa) -> None:
        self.values, self.kwargs = {}, {}
        model.log = self

    def __call__(self, name, value, **kwargs):
        self.values[name], self.kwargs[name] = value, kwargs


def test_a_training_step_returns_the_weighted_sum_and_logs_each_term(tiny_coca_json):
    model = _model(tiny_coca_json, caption_loss_weight=3.0, clip_loss_weight=0.5, flip={"mask_ratio": 0.5})
    images, tokens = _batch(model)
    logged = _Logged(model)
    torch.manual_seed(3)
    loss = model.training_step({"image": images, "text": tokens}, 0)
    torch.manual_seed(3)
    contrastive, caption = model.losses(images, tokens)
    assert loss.item() == pytest.approx((contrastive + caption).item(), rel=1e-6) and loss.requires_grad
    assert set(logged.values) == {"train/loss", "train/contrastive_loss", "train/caption_loss", "train/logit_scale",
                                  "train/image_mask_ratio"}
    assert logged.values["train/loss"] is loss and logged.kwargs["train/loss"] == {"prog_bar": True}
    assert logged.values["train/contrastive_loss"].item() == pytest.approx(contrastive.item(), rel=1e-6)
    assert logged.values["train/caption_loss"].item() == pytest.approx(caption.item(), rel=1e-6)
    assert not logged.values["train/caption_loss"].requires_grad
    assert logged.values["train/logit_scale"].item() == pytest.approx(model.model.logit_scale.exp().item())
    assert logged.values["train/image_mask_ratio"] == 0.5


def test_a_validation_epoch_logs_the_captioning_figures(tiny_coca_json):
    model = _model(tiny_coca_json).eval()
    logged = _Logged(model)
    shown = []
    model.validation.log_to = shown.append  # CLIP's val/loss and recalls: tests/models/test_coca_validation.py
    model.on_validation_epoch_end()
    assert shown == [model]
    assert list(logged.values) == ["val/contrastive_loss", "val/caption_loss", "val/caption_token_top1"]
    # (identity: a Metric's == makes a new metric)
    assert logged.values["val/contrastive_loss"] is model.objectives["contrastive"].val_loss
    assert logged.values["val/caption_loss"] is model.objectives["caption"].val_loss
    assert logged.values["val/caption_token_top1"] is model.objectives["caption"].val_token_top1


def _predicting(model: CoCa, token: int) -> CoCa:
    """The decoder made to predict ``token`` at every position (as tests/models/test_coca_validation.py)."""
    decoder = model.model.text_decoder
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        decoder.ln_final.bias.copy_(torch.randn(decoder.ln_final.bias.shape, generator=g))
        decoder.text_projection[:, token] = 20 * decoder.ln_final.bias
    return model


def test_token_accuracy_counts_caption_tokens_only_and_a_one_token_batch_weighs_one(tiny_coca_json):
    model = _predicting(_model(tiny_coca_json).eval(), 0)  # padding everywhere: no caption token is right
    images, tokens = _batch(model)
    with torch.no_grad():
        model.validation_step({"image": images, "text": tokens}, 0)
    assert model.objectives["caption"].val_token_top1.compute().item() == 0.0
    # An empty caption: its one label token is end-of-text, predicted right.
    eot = model.generation_ids()["eos_token_id"]
    model = _predicting(_model(tiny_coca_json).eval(), eot)
    tokens = model.tokenizer([""])
    with torch.no_grad():
        model.validation_step({"image": images[:1], "text": tokens}, 0)
        out = model(images[:1], tokens)
    assert int((out["labels"] != model.pad_id).sum()) == 1
    assert model.objectives["caption"].val_token_top1.compute().item() == 1.0
    model = _model(tiny_coca_json).eval()  # untrained: a caption loss near log(V), not near 0
    with torch.no_grad():
        model.validation_step({"image": images[:1], "text": tokens}, 0)
        out = model(images[:1], tokens)
    want = torch.nn.functional.cross_entropy(out["logits"][0, :1], out["labels"][0, :1]).item()
    assert want > 1 and model.objectives["caption"].val_loss.compute().item() == pytest.approx(want, rel=1e-5)


def test_generation_ids_come_from_either_kind_of_tokenizer(tiny_coca_json):
    model = CoCa(tiny_coca_json)
    assert model.generation_ids() == {"sot_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 0}
    hf = types.SimpleNamespace(eos_token_id=2, bos_token_id=1, cls_token_id=101)
    model._tokenizer = types.SimpleNamespace(tokenizer=hf)
    assert model.generation_ids() == {"sot_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    hf.bos_token_id = None  # BERT-like: [CLS] starts a caption
    assert model.generation_ids() == {"sot_token_id": 101, "eos_token_id": 2, "pad_token_id": 0}
    hf.eos_token_id = None  # a wrapped tokenizer without an end token: the wrapper's own ids
    model._tokenizer = types.SimpleNamespace(tokenizer=hf, sot_token_id=7, eot_token_id=8)
    assert model.generation_ids() == {"sot_token_id": 7, "eos_token_id": 8, "pad_token_id": 0}
    model._tokenizer = types.SimpleNamespace(tokenizer=object(), sot_token_id=7, eot_token_id=8)  # no ids at all
    assert model.generation_ids() == {"sot_token_id": 7, "eos_token_id": 8, "pad_token_id": 0}


def test_generate_passes_the_ids_and_takes_seq_len_within_the_text_context(tiny_coca_json, monkeypatch):
    model = CoCa(tiny_coca_json).eval()
    calls = []
    monkeypatch.setattr(coca_module.generation, "generate",
                        lambda m, images, kind, **kw: calls.append((m, images, kind, kw)) or "captions")
    images = torch.zeros(1, 3, 32, 32)
    ids = {"sot_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 0}
    assert model.generate(images) == "captions"
    assert calls[-1][0] is model.model and calls[-1][1] is images
    assert calls[-1][2:] == ("beam_search", {"seq_len": 16, **ids})  # the whole context; no max_seq_len
    model.generate(images, "top_k", seq_len=2, top_k=1)
    assert calls[-1][2:] == ("top_k", {"seq_len": 2, **ids, "top_k": 1, "max_seq_len": 16})
    model.generate(images, "top_p", seq_len=16, max_seq_len=9)
    assert calls[-1][2:] == ("top_p", {"seq_len": 16, **ids, "max_seq_len": 9})
    for bad in (1, 17):
        with pytest.raises(ValueError) as err:
            model.generate(images, seq_len=bad)
        assert str(err.value) == f"seq_len must be in [2, 16] (the text context), got {bad}"
    assert len(calls) == 3
