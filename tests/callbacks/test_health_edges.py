"""EmbeddingHealth (mmssl.callbacks.health) in process, past the Trainer test: its bounds and messages,
what setup reads (and when it reads nothing), when each hook computes and where the figures go,
a CLIP's text figures and logit scale and bias, the collapse warning's bound, and each rank's slice of
the buffer (padded with row 0, gathered, cut back) simulated on one process."""

from __future__ import annotations

import contextlib
import types
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import mmssl.callbacks.health as health_module
from mmssl.callbacks.health import EmbeddingHealth
from mmssl.data.heldout import HeldOut
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.health import alignment, modality_gap, rankme, uniformity


class ImageModel(pl.LightningModule):
    """encode_image of (B, 3, 4, 4) images: a fixed linear map to 6 dimensions."""

    image_size, image_mean, image_std = 4, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3 * 4 * 4, 6)
        self.batches = []

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        self.batches.append(images.clone())
        assert not self.training and not torch.is_grad_enabled()
        return self.net(images.flatten(1)).double()  # a dtype other than float32: the figures are float32


class TextModel(ImageModel):
    """A CLIP-like model: forward(images, tokens) -> features, logit scale and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Embedding(10, 6)
        self.tokens = []

    def tokenizer(self, texts):  # pragma: no cover - read, never called here
        raise AssertionError

    def encode_text(self, tokens):  # pragma: no cover
        raise AssertionError

    def forward(self, images, tokens):
        self.tokens.append(tokens.clone())
        return {"image_features": self.encode_image(images), "text_features": self.text(tokens).mean(1),
                "logit_scale": torch.tensor(12.5, requires_grad=True), "logit_bias": torch.tensor(-3.0)}


def _trainer(**kw):
    base = dict(world_size=1, global_rank=0, global_step=4, is_global_zero=True, loggers=[], sanity_checking=False,
                state=types.SimpleNamespace(fn="fit"), datamodule=None, limit_val_batches=1.0,
                precision_plugin=types.SimpleNamespace(forward_context=contextlib.nullcontext))
    return types.SimpleNamespace(**{**base, **kw})


def _buffer(n: int, tokens: bool = False) -> HeldOut:
    g = torch.Generator().manual_seed(n)
    return HeldOut(torch.randn(n, 3, 4, 4, generator=g),
                   torch.randint(0, 10, (n, 3), generator=g) if tokens else None)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_samples": 1}, "init_args.max_samples must be >= 2, got 1"),
    ({"every_n_steps": 0}, "init_args.every_n_steps must be >= 1 or null, got 0"),
    ({"collapse_threshold": -0.01}, "init_args.collapse_threshold must lie in [0, 1], got -0.01"),
    ({"collapse_threshold": 1.01}, "init_args.collapse_threshold must lie in [0, 1], got 1.01"),
    ({"batch_size": 0}, "init_args.batch_size must be >= 1, got 0"),
])
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError) as err:
        EmbeddingHealth(**kwargs)
    assert str(err.value) == f"EmbeddingHealth: {message}"


def test_settings_at_their_bounds_are_taken_and_the_defaults_are_the_documented_ones():
    for kwargs in ({"max_samples": 2}, {"every_n_steps": 1}, {"collapse_threshold": 0.0},
                   {"collapse_threshold": 1.0}, {"batch_size": 1}):
        EmbeddingHealth(**kwargs)
    health = EmbeddingHealth()
    assert (health.data, health.max_samples, health.every_n_steps, health.collapse_threshold, health.batch_size) == (
        None, 256, None, 0.05, 256)
    assert health.buffer is None and health.last_call_ms is None


def _recording_reader(monkeypatch, buffer):
    calls = []

    def read(data, transform, tokenizer, limit, **kwargs):
        calls.append((data, transform, tokenizer, limit, kwargs))
        return buffer

    monkeypatch.setattr(health_module, "read_heldout", read)
    return calls


def test_setup_reads_the_buffer_with_the_models_transform_and_the_data_modules_keys(monkeypatch):
    calls = _recording_reader(monkeypatch, _buffer(4))
    dm = types.SimpleNamespace(image_key="png", text_key="caption", max_image_pixels=1234, eval_data=None,
                               val_data="val/{0..1}.tar")
    health = EmbeddingHealth(max_samples=9)
    model = ImageModel()
    health.setup(_trainer(datamodule=dm), model, "fit")
    ((data, transform, tokenizer, limit, kwargs),) = calls
    assert (data, tokenizer, limit) == ("val/{0..1}.tar", None, 9)
    assert kwargs == {"image_key": "png", "text_key": "caption", "max_image_pixels": 1234}
    from PIL import Image

    image = Image.new("RGB", (10, 7), (200, 30, 90))
    torch.testing.assert_close(transform(image), eval_transform(4, model.image_mean, model.image_std)(image))
    assert health.buffer is not None
    # A CLIP's buffer holds captions, tokenized by the model; a data module without those keys passes none.
    clip = TextModel()
    EmbeddingHealth(data="own.tar").setup(_trainer(datamodule=types.SimpleNamespace(image_key=None)), clip, "validate")
    assert calls[-1][0] == "own.tar" and calls[-1][2] == clip.tokenizer and calls[-1][4] == {}


def test_a_tokenizer_is_passed_only_for_a_model_with_a_text_tower_and_no_set_turns_health_off(monkeypatch):
    calls = _recording_reader(monkeypatch, _buffer(4))
    image_only = ImageModel()
    image_only.tokenizer = "a tokenizer without a text tower"
    EmbeddingHealth(data="x.tar").setup(_trainer(), image_only, "validate")
    no_tokenizer = ImageModel()
    no_tokenizer.encode_text = lambda tokens: tokens
    EmbeddingHealth(data="x.tar").setup(_trainer(), no_tokenizer, "validate")
    assert [c[2] for c in calls] == [None, None]
    health = EmbeddingHealth()
    with pytest.warns(UserWarning) as caught:
        health.setup(_trainer(), ImageModel(), "validate")
    assert [str(w.message) for w in caught] == [
        "EmbeddingHealth: no held-out set (data.val_data, or init_args.data in its trainer.callbacks entry): the "
        "health/* figures are off for this run"]
    assert health.buffer is None and len(calls) == 2


def test_the_cost_of_a_computation_is_kept_in_milliseconds(monkeypatch):
    clock = iter([10.0, 10.25])
    monkeypatch.setattr(health_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    health = EmbeddingHealth()
    health.buffer = _buffer(4)
    health.evaluate(_trainer(), ImageModel())
    assert health.last_call_ms == pytest.approx(250.0)


def test_setup_reads_nothing_when_no_validation_runs_unless_it_has_its_own_cadence(monkeypatch):
    calls = _recording_reader(monkeypatch, _buffer(4))
    off = _trainer(limit_val_batches=0)
    EmbeddingHealth(data="x.tar").setup(off, ImageModel(), "fit")
    assert calls == []
    EmbeddingHealth(data="x.tar").setup(off, ImageModel(), "validate")  # mmssl validate runs it
    EmbeddingHealth(data="x.tar", every_n_steps=3).setup(off, ImageModel(), "fit")
    assert len(calls) == 2


def test_setup_names_the_key_and_the_set_in_every_refusal_and_warns_of_skipped_samples(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("no shard at x/0.tar")

    monkeypatch.setattr(health_module, "read_heldout", missing)
    with pytest.raises(FileNotFoundError) as err:
        EmbeddingHealth(data="x/{0..1}.tar").setup(_trainer(), ImageModel(), "validate")
    assert str(err.value) == "EmbeddingHealth: init_args.data='x/{0..1}.tar': no shard at x/0.tar"
    dm = types.SimpleNamespace(eval_data="held/out")
    for model, hint in ((ImageModel(), ""), (TextModel(), ", captions needed for a CLIP")):
        _recording_reader(monkeypatch, HeldOut(torch.zeros(1, 3, 4, 4), None, skipped=3))
        with pytest.raises(ValueError) as err:
            EmbeddingHealth().setup(_trainer(datamodule=dm), model, "validate")
        assert str(err.value) == ("EmbeddingHealth: data.eval_data='held/out' gave 1 readable samples "
                                  f"(3 skipped{hint}); the figures need at least 2")
    _recording_reader(monkeypatch, HeldOut(torch.zeros(2, 3, 4, 4), None, skipped=1))
    with pytest.warns(UserWarning) as caught:
        EmbeddingHealth().setup(_trainer(datamodule=dm), ImageModel(), "validate")
    assert [str(w.message) for w in caught] == [
        "EmbeddingHealth: 1 unreadable samples of 'held/out' left out of the buffer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EmbeddingHealth().setup(_trainer(datamodule=dm, is_global_zero=False), ImageModel(), "validate")
        _recording_reader(monkeypatch, _buffer(2))
        EmbeddingHealth().setup(_trainer(datamodule=dm), ImageModel(), "validate")


def _logged(model):
    calls = []
    model.log = lambda name, value, **kwargs: calls.append((name, value, kwargs))
    return calls


def test_validation_logs_every_figure_synced_except_in_the_sanity_check_or_on_a_step_cadence():
    model = ImageModel()
    health = EmbeddingHealth()
    health.buffer = _buffer(5)
    logged = _logged(model)
    health.on_validation_epoch_end(_trainer(sanity_checking=True), model)
    assert logged == []
    health.on_validation_epoch_end(_trainer(), model)
    assert [(n, k) for n, _, k in logged] == [(n, {"sync_dist": True}) for n in (
        "health/rankme", "health/uniformity", "health/alignment")]
    assert [v for _, v, _ in logged] == list(health.evaluate(_trainer(), model).values())
    stepped = EmbeddingHealth(every_n_steps=2)
    stepped.buffer = _buffer(5)
    logged.clear()
    stepped.on_validation_epoch_end(_trainer(), model)  # fit: its training-step cadence logs instead
    assert logged == []
    stepped.on_validation_epoch_end(_trainer(state=types.SimpleNamespace(fn="validate")), model)
    assert len(logged) == 3


class _Logger:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((sorted(metrics), step))


def test_the_step_cadence_logs_every_nth_step_once_to_every_logger_of_rank_zero():
    model = ImageModel()
    health = EmbeddingHealth(every_n_steps=2)
    health.buffer = _buffer(5)
    loggers = [_Logger(), _Logger()]
    for step in (1, 2, 2, 3, 4):  # 2 twice: a second micro-batch of the same optimizer step
        health.on_train_batch_end(_trainer(global_step=step, loggers=loggers), model, None, None, 0)
    figures = ["health/alignment", "health/rankme", "health/uniformity"]
    assert loggers[0].calls == loggers[1].calls == [(figures, 2), (figures, 4)]
    other = _Logger()
    model.batches.clear()
    health.on_train_batch_end(_trainer(global_step=6, loggers=[other], is_global_zero=False), model, None, None, 0)
    assert other.calls == [] and len(model.batches) == 2  # computed on every rank, written by rank 0
    EmbeddingHealth().on_train_batch_end(_trainer(global_step=2, loggers=[other]), model, None, None, 0)
    assert other.calls == []  # no cadence: validation logs


def test_an_image_models_figures_are_those_of_its_embeddings_and_their_flips():
    model = ImageModel()
    health = EmbeddingHealth(batch_size=2)
    health.buffer = _buffer(5)
    out = health.evaluate(_trainer(), model)
    with torch.no_grad():
        image = model.net(health.buffer.images.flatten(1)).float()
        flipped = model.net(health.buffer.images.flip(-1).flatten(1)).float()
    assert out == pytest.approx({"health/rankme": rankme(image), "health/uniformity": uniformity(image),
                                 "health/alignment": alignment(image, flipped)}, rel=1e-5)
    assert len(model.batches) == 6  # 3 batches of at most 2, the images and their flips
    assert health.last_call_ms >= 0
    assert EmbeddingHealth().evaluate(_trainer(), model) == {}  # no buffer


def test_a_clips_figures_add_the_text_tower_and_the_logit_scale_and_bias():
    model = TextModel()
    health = EmbeddingHealth(batch_size=3)
    health.buffer = _buffer(5, tokens=True)
    out = health.evaluate(_trainer(), model)
    with torch.no_grad():
        image = model.net(health.buffer.images.flatten(1)).float()
        text = model.text(health.buffer.tokens).mean(1)
    want = {"health/rankme": rankme(image), "health/uniformity": uniformity(image),
            "health/alignment": alignment(image, text), "health/rankme_text": rankme(text),
            "health/uniformity_text": uniformity(text), "health/modality_gap": modality_gap(image, text),
            "health/logit_scale": 12.5, "health/logit_bias": -3.0}
    assert out == pytest.approx(want, rel=1e-5)
    assert torch.equal(torch.cat(model.tokens), health.buffer.tokens)


def test_a_collapse_warns_once_below_the_threshold_of_the_bound(monkeypatch):
    health = EmbeddingHealth(collapse_threshold=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        health._warn_if_collapsed(2.0, 4, 7)  # at the bound: no warning
    with pytest.warns(UserWarning) as caught:
        health._warn_if_collapsed(1.99, 4, 7)
    assert str(caught[0].message) == (
        "EmbeddingHealth: RankMe 1.99 at step 7 is below collapse_threshold 0.5 x 4 (the most it can be on this "
        "buffer): the embedding is collapsing onto few directions. Check the learning rate, warm-up and loss; "
        "this warning is given once.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        health._warn_if_collapsed(0.5, 4, 8)
    # The bound is min(N, D): 5 samples of a 6-dimensional embedding.
    seen = []
    monkeypatch.setattr(EmbeddingHealth, "_warn_if_collapsed",
                        lambda self, value, most, step: seen.append((most, step)))
    health = EmbeddingHealth()
    health.buffer = _buffer(5)
    health.evaluate(_trainer(global_step=11), ImageModel())
    assert seen == [(5, 11)]


@pytest.mark.parametrize("n, world", [(5, 2), (5, 4), (4, 2), (3, 4)])
def test_each_rank_embeds_its_slice_padded_with_row_zero_and_the_gather_is_cut_back(n, world):
    buffer = _buffer(n, tokens=True)
    per = -(-n // world)
    gathered = {}
    for r in range(world):
        model = TextModel()
        health = EmbeddingHealth(batch_size=1)
        health.buffer = buffer
        rows, step = health._slice(_trainer(world_size=world, global_rank=r))
        assert step == per and rows == slice(min(r * per, n), min(r * per + per, n))
        want = torch.cat([buffer.images, buffer.images[:1].expand(world * per - n, 3, 4, 4)])[r * per:(r + 1) * per]
        embedded = {}

        def all_gather(x, r=r, embedded=embedded):
            key = "image" if not embedded else "pair"
            embedded[key] = x
            return torch.stack([gathered.get((q, key), torch.zeros_like(x)) if q != r else x for q in range(world)])

        model.all_gather = all_gather
        out = health._embed(_trainer(world_size=world, global_rank=r), model)
        assert torch.equal(torch.cat(model.batches), want) and len(model.batches) == per
        want_tokens = torch.cat([buffer.tokens, buffer.tokens[:1].expand(world * per - n, 3)])
        assert torch.equal(torch.cat(model.tokens), want_tokens[r * per:(r + 1) * per])
        for key, value in embedded.items():
            gathered[(r, key)] = value
            assert value.dtype == torch.float32 and value.shape == (per, 6)
        assert out["image"].shape == (n, 6) and out["pair"].shape == (n, 6) and out["logit_scale"] == 12.5
    with torch.no_grad():
        image = model.net(buffer.images.flatten(1)).float()
    torch.testing.assert_close(out["image"], image)  # the last rank has every rank's rows, in order
