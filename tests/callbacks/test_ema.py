"""mmssl.callbacks.EMA: the average against a hand-written EMA, its checkpoint keys, the one
reader's choice of raw or averaged weights (tools' ``--ema``), and which weights a resume takes
(with LoRA, and without the callback). The exact resume, 1 and 2 ranks and ``evaluate: both``
through the CLI are in tests/checkpoints/test_resume.py; FSDP2 in tests/checkpoints/test_fsdp2_ema.py."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from mmssl.callbacks import EMA
from mmssl.callbacks.ema import EVALUATE, ema_decay
from mmssl.checkpoints.load import load_lightning, read_lightning
from mmssl.checkpoints.read import read_state_dict
from mmssl.export import export_checkpoint, to_timm
from mmssl.models.mae import MAE
from tests.tiny import tiny_mae

REPO = Path(__file__).resolve().parents[2]
TINY_MAE = tiny_mae(patch_size=4, decoder_embed_dim=16)


def test_fsdp1_is_refused_before_a_copy_is_made():
    """FSDP 1 flattens the parameters the average would pair with; FSDP2 is supported (its average
    is sharded like the weights: tests/checkpoints/test_fsdp2_ema.py)."""
    import types

    from lightning.pytorch.strategies import FSDPStrategy

    trainer = types.SimpleNamespace(strategy=FSDPStrategy())
    ema = EMA()
    with pytest.raises(ValueError, match="EMA: FSDPStrategy \\(FSDP 1\\) shards the weights .* use EMA with FSDP2"):
        ema.setup(trainer, MAE(**TINY_MAE), "fit")
    assert ema.averaged_module() is None


@pytest.mark.parametrize("decay", [0.0, 1.0, 1.5, -0.1])
def test_decay_outside_the_open_unit_interval_is_refused_naming_the_key(decay):
    with pytest.raises(ValueError, match=r"EMA: init_args.decay .* must be in \(0, 1\), got"):
        EMA(decay=decay)


def test_other_settings_are_refused_naming_their_key():
    for kwargs, key in (({"update_every_n_steps": 0}, "update_every_n_steps"), ({"warmup_power": 0}, "warmup_power"),
                        ({"evaluate": "average"}, "evaluate")):
        with pytest.raises(ValueError, match=f"init_args.{key}"):
            EMA(**kwargs)


def test_warmup_follows_timm_model_ema_v3():
    timm_ema = pytest.importorskip("timm.utils.model_ema")
    reference = timm_ema.ModelEmaV3(nn.Linear(1, 1), decay=0.99, use_warmup=True, warmup_power=0.75)
    for step in (0, 1, 5, 100, 10**6):
        # timm counts the update (1 = the first), mmssl the optimizer step before it (0 = the first)
        assert ema_decay(0.99, step, 0.75) == pytest.approx(reference.get_decay(step + 1), abs=0)
    assert ema_decay(0.99, 7) == 0.99


class _BNNet(pl.LightningModule):
    """A linear layer and a BatchNorm: parameters, float buffers and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        # A constant outside the checkpoint, as open_clip's causal mask: copied, never averaged.
        self.register_buffer("mask", torch.tensor([float("-inf"), 0.0]), persistent=False)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Record(pl.Callback):
    """The module's state after every optimizer step (listed before EMA: it sees the same state)."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.states.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def test_average_is_the_ema_of_every_nth_step_with_warmup_and_buffers(tmp_path):
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(28, 4)), batch_size=4)
    record, ema = _Record(), EMA(decay=0.8, warmup_power=0.75, update_every_n_steps=2, evaluate="raw")
    trainer = pl.Trainer(max_steps=7, callbacks=[record, ema], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
    model = _BNNet()
    trainer.fit(model, data)
    want: dict[str, torch.Tensor] = {}
    for step, state in enumerate(record.states):
        if step % 2:
            continue
        d = ema_decay(0.8, step, 0.75)
        want = dict(state) if not want else {
            k: (d * want[k] + (1 - d) * v if v.is_floating_point() else v) for k, v in state.items()}
    got = ema.averaged_module().state_dict()
    assert want.keys() == got.keys() and "net.1.running_mean" in got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=key)
    assert got["net.1.num_batches_tracked"] == 7 and record.states[6]["net.1.num_batches_tracked"] == 7
    assert torch.equal(ema.averaged_module().mask, model.mask)  # -inf stays -inf (averaged: nan)
    assert not torch.equal(got["net.0.weight"], model.net[0].weight)  # evaluate: raw keeps the raw weights

    # The checkpoint: WeightAveraging's convention, read back raw by default, averaged with ema.
    path = tmp_path / "ema.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert torch.equal(checkpoint["state_dict"]["net.0.weight"], got["net.0.weight"])
    assert torch.equal(checkpoint["current_model_state"]["net.0.weight"], model.net[0].weight)
    assert int(checkpoint["averaging_state"]["n_averaged"]) == 4
    assert torch.equal(read_state_dict(str(path))["net.0.weight"], model.net[0].weight)
    assert torch.equal(read_state_dict(str(path), ema=True)["net.0.weight"], got["net.0.weight"])


def _mae_checkpoint(path: Path, ema: bool) -> tuple[dict, dict]:
    """A tiny MAE checkpoint; with ``ema``, an 'averaged' state beside the raw one."""
    torch.manual_seed(0)
    model = MAE(**TINY_MAE)
    raw = model.state_dict()
    averaged = {k: v + 0.01 if v.is_floating_point() else v for k, v in raw.items()}
    hparams = {**dict(model.hparams), "_class_path": "mmssl.models.mae.MAE"}
    checkpoint = {"state_dict": averaged if ema else raw, "hyper_parameters": hparams}
    if ema:
        checkpoint.update(current_model_state=raw, averaging_state={"n_averaged": torch.tensor(3)})
    torch.save(checkpoint, path)
    return raw, averaged


def test_loaders_and_export_read_raw_weights_unless_ema(tmp_path):
    raw, averaged = _mae_checkpoint(tmp_path / "ema.ckpt", ema=True)
    ckpt = str(tmp_path / "ema.ckpt")
    assert torch.equal(read_lightning(ckpt)["state_dict"]["encoder.cls_token"], raw["encoder.cls_token"])
    module = load_lightning(ckpt, ema=True)
    assert torch.equal(module.state_dict()["encoder.cls_token"], averaged["encoder.cls_token"])
    for ema, want in ((False, raw), (True, averaged)):
        out = tmp_path / f"timm_{ema}.pth"
        state = export_checkpoint(ckpt, "timm", str(out), ema=ema)
        for key, value in to_timm(want).items():
            assert torch.equal(state[key], value), key


def test_ema_of_a_checkpoint_without_one_is_refused_naming_the_file(tmp_path, capsys):
    _mae_checkpoint(tmp_path / "plain.ckpt", ema=False)
    ckpt = str(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="plain.ckpt: --ema asks for averaged weights"):
        load_lightning(ckpt, ema=True)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tools.export import main

    assert main(["--ckpt", ckpt, "--format", "timm", "--output", str(tmp_path / "x.pth"), "--ema"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("export: ") and "plain.ckpt" in err and "--ema" in err and err.count("\n") == 1
    assert not (tmp_path / "x.pth").exists()


class _ValNet(_BNNet):
    """_BNNet whose validation logs a figure of its weights: which weights were validated is read off it."""

    def validation_step(self, batch, batch_idx):
        self.log("val/w", self.net[1].weight.sum())  # the BatchNorm scale: what the loss moves


def _weights_figure(state: dict[str, torch.Tensor]) -> float:
    return float(state["net.1.weight"].sum())


def _fit(tmp_path: Path, evaluate: str) -> tuple[pl.Trainer, _ValNet, EMA, _Record]:
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=4)
    record, ema = _Record(), EMA(decay=0.7, evaluate=evaluate)
    trainer = pl.Trainer(max_epochs=1, callbacks=[record, ema], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu",
                         num_sanity_val_steps=0, enable_checkpointing=False)
    model = _ValNet()
    trainer.fit(model, data, val_dataloaders=data)
    return trainer, model, ema, record


@pytest.mark.parametrize("evaluate", ["raw", "ema", "both"])
def test_fit_validates_and_ends_with_the_weights_evaluate_names(tmp_path, evaluate):
    trainer, model, ema, record = _fit(tmp_path, evaluate)
    raw, averaged = record.states[-1], ema.averaged_module().state_dict()
    assert abs(_weights_figure(raw) - _weights_figure(averaged)) > 1e-3  # the two are told apart
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    want = {"raw": {"val/w": _weights_figure(raw)}, "ema": {"val/w": _weights_figure(averaged)},
            "both": {"val/w": _weights_figure(raw), "val/w_ema": _weights_figure(averaged)}}[evaluate]
    assert logged == pytest.approx(want, abs=1e-5)
    # After fit the module holds the averaged weights with ``ema`` (Lightning's WeightAveraging), else the raw ones.
    end = averaged if evaluate == "ema" else raw
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, end[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.filterwarnings("ignore:You're using the WeightAveraging callback, but loading a checkpoint")
def test_validate_of_an_ema_checkpoint_scores_the_weights_evaluate_names(tmp_path):
    trainer, model, ema, record = _fit(tmp_path, "raw")
    path = tmp_path / "ema.ckpt"
    trainer.save_checkpoint(path)
    raw, averaged = _weights_figure(record.states[-1]), _weights_figure(ema.averaged_module().state_dict())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    want = {"raw": {"val/w": raw}, "ema": {"val/w": averaged}, "both": {"val/w": raw, "val/w_ema": averaged}}
    for evaluate, figures in want.items():
        validator = pl.Trainer(callbacks=[EMA(decay=0.7, evaluate=evaluate)], logger=False, enable_progress_bar=False,
                               enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
        [logged] = validator.validate(_ValNet(), data, ckpt_path=str(path), verbose=False)
        assert logged == pytest.approx(figures, abs=1e-5), evaluate
    # A checkpoint without an average: raw scores its weights, ema and both are refused before any batch.
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["current_model_state"], checkpoint["averaging_state"]
    torch.save(checkpoint, tmp_path / "plain.ckpt")
    for evaluate in EVALUATE:
        validator = pl.Trainer(callbacks=[EMA(decay=0.7, evaluate=evaluate)], logger=False, enable_progress_bar=False,
                               enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
        if evaluate == "raw":
            [logged] = validator.validate(_ValNet(), data, ckpt_path=str(tmp_path / "plain.ckpt"), verbose=False)
            assert logged == pytest.approx({"val/w": averaged}, abs=1e-5)
        else:
            with pytest.raises(ValueError, match=f"evaluate='{evaluate}' needs --ckpt_path .*plain.ckpt: no averaged"):
                validator.validate(_ValNet(), data, ckpt_path=str(tmp_path / "plain.ckpt"), verbose=False)


# ---- resumes through the CLI (one process, in this interpreter) ---------------------------------

def _cli(root: Path, demo, model: list[str], steps: int, *extra: str) -> list[str]:
    recipe = "clip" if any("model_name" in a for a in model) else "mae"
    return ["fit", "--config", str(REPO / f"configs/demo/{recipe}.yaml"), *model,
            f"--data.init_args.demo_dir={demo.root}", "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=0", f"--trainer.default_root_dir={root}",
            "--trainer.enable_progress_bar=false", f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=1",
            "--trainer.callbacks+=tests.helpers.DumpStartParams", f"--trainer.callbacks.folder={root}/params", *extra]


EMA_ARGS = ["--trainer.callbacks+=mmssl.callbacks.EMA", "--trainer.callbacks.decay=0.5",
            "--trainer.callbacks.evaluate=both"]
MAE_ARGS = [f"--model.init_args.{k}={v}" for k, v in dict(embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=16,
                                                           decoder_depth=1, decoder_num_heads=2).items()]


def test_a_resume_without_the_ema_callback_takes_the_raw_weights_and_says_so(tmp_path, tiny_demo):
    """#44 item 7: Lightning loads a checkpoint's ``state_dict``, which WeightAveraging fills with
    the average; a resume without the callback then trained the average with the raw weights'
    optimizer state, silently. mmssl fit takes the raw weights and warns which it took."""
    from tests.cli_runs import run_one_process

    run_one_process(_cli(tmp_path, tiny_demo, MAE_ARGS, 2, *EMA_ARGS))
    [last] = tmp_path.glob("version_0/checkpoints/last.ckpt")
    saved = torch.load(last, weights_only=True)
    with pytest.warns(UserWarning, match=r"last.ckpt holds the raw weights and an EMA of them: the model is loaded "
                                         r"with the raw weights \('current_model_state'"):
        run_one_process(_cli(tmp_path, tiny_demo, MAE_ARGS, 3, "--ckpt_path", "last"))
    start = torch.load(tmp_path / "params" / "start_rank0.pt", weights_only=True)
    raw, averaged = saved["current_model_state"], saved["state_dict"]
    assert any(not torch.equal(raw[k], averaged[k]) for k in raw)
    assert all(torch.equal(start[k], raw[k]) for k in raw), "the resume started from the average"


def test_a_lora_run_with_an_ema_resumes_with_its_average(tmp_path, tiny_demo, tiny_clip_json):
    """#44 item 6: the LoRA checkpoint hook keeps the adapters (and what else trains) of the
    average in ``state_dict``, while the raw weights keep the base; the resume refused the average
    (missing keys). It resumes with the average's adapters and the base of the raw weights."""
    from mmssl.models.clip import CLIP
    from tests.cli_runs import run_one_process

    torch.manual_seed(0)
    torch.save(CLIP(model_name=tiny_clip_json).model.state_dict(), tmp_path / "base.pth")
    model = [f"--model.init_args.model_name={tiny_clip_json}", f"--model.init_args.pretrained={tmp_path / 'base.pth'}",
             "--model.init_args.lora={r: 2}"]
    dump = ["--trainer.callbacks+=tests.checkpoints.test_fsdp2_ema.DumpEMA",
            f"--trainer.callbacks.folder={tmp_path}/dump"]
    run_one_process(_cli(tmp_path, tiny_demo, model, 2, *EMA_ARGS))
    [last] = tmp_path.glob("version_0/checkpoints/last.ckpt")
    saved = torch.load(last, weights_only=True)
    assert len(saved["state_dict"]) < len(saved["current_model_state"])  # the average: what trains only
    run_one_process(_cli(tmp_path, tiny_demo, model, 3, *EMA_ARGS, *dump, "--ckpt_path", "last"))
    start = torch.load(tmp_path / "dump" / "start_rank0.pt", weights_only=True)
    for key, value in saved["state_dict"].items():
        assert torch.equal(start[f"ema/{key}"], value), key
    base = [k for k in saved["current_model_state"] if k not in saved["state_dict"]]
    assert base and all(torch.equal(start[f"ema/{k}"], saved["current_model_state"][k]) for k in base)
