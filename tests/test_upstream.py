"""Each upstream internal that ``mmssl.upstream`` touches still means what mmssl assumes.

These run against the installed torch / Lightning / timm / open_clip, so an upgrade that changes
one of them fails here, with a message naming the library, the internal and what changed,
instead of silently changing a user's run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import lightning.pytorch as pl
import open_clip
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers.logger import Logger
from torch import nn

from mmssl import upstream
from tests.helpers import one_process_group


def _changed(library: str, internal: str, what: str) -> str:
    return (f"{library} changed {internal}: {what}. mmssl.upstream relies on it; update the function "
            "there (and its callers) for this version")


# Lightning ---------------------------------------------------------------------------------------


class _Steps(Logger):
    """Keeps the step of every metrics row Lightning writes."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    name, version = "steps", 0

    def log_metrics(self, metrics, step=None) -> None:
        if "train_x" in metrics:
            self.steps.append(step)

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass


class _Module(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_x", float(batch_idx))
        return out


class _Probe(pl.Callback):
    def __init__(self, jump_at: int | None = None) -> None:
        self.jump_at = jump_at
        self.before: list[tuple[int | None, int, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.jump_at:
            upstream.set_lightning_logging_step(trainer, 10)
        self.before.append((upstream.lightning_logging_step(trainer), trainer.global_step,
                            upstream.lightning_logs_this_step(trainer)))


def _fit(probe: _Probe, log_every_n_steps: int) -> _Steps:
    logger = _Steps()
    trainer = pl.Trainer(max_steps=4, log_every_n_steps=log_every_n_steps, logger=logger, callbacks=[probe],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         # One process, and what is checked is the training loop's logging counter:
                         # validation would only add steps that the counter does not see.
                         num_sanity_val_steps=0, limit_val_batches=0, accelerator="cpu", devices=1)
    trainer.fit(_Module())
    return logger


def test_lightning_logging_counter_and_cadence():
    probe = _Probe()
    logger = _fit(probe, log_every_n_steps=2)
    counters = [c for c, _, _ in probe.before]
    assert counters == [g for _, g, _ in probe.before] == [0, 1, 2, 3], _changed(
        "Lightning", "fit_loop.epoch_loop._batches_that_stepped",
        f"it no longer equals global_step before each batch (counter {counters}, global_step "
        f"{[g for _, g, _ in probe.before]})")
    kept = [k for _, _, k in probe.before]
    assert kept == [False, True, False, True], _changed(
        "Lightning", "trainer._logger_connector.should_update_logs",
        f"with log_every_n_steps=2 it said {kept} for steps 0..3, not [False, True, False, True]")
    assert logger.steps == [1, 3], _changed(
        "Lightning", "the logging of on_step metrics",
        f"with log_every_n_steps=2 batches 0..3 were written at steps {logger.steps}, not [1, 3] "
        "(the steps should_update_logs says are kept)")


def test_lightning_logs_at_the_counter():
    probe = _Probe(jump_at=2)
    logger = _fit(probe, log_every_n_steps=1)
    assert logger.steps == [0, 1, 10, 11], _changed(
        "Lightning", "fit_loop.epoch_loop._batches_that_stepped",
        f"after setting it to 10 before batch 2, batches 0..3 were logged at steps {logger.steps}, "
        "not [0, 1, 10, 11]: it is no longer the step Lightning logs at (LogStepOnResume sets it)")


def test_lightning_module_trainer_attribute():
    module = BoringModel()
    assert upstream.attached_trainer(module) is None, _changed(
        "Lightning", "LightningModule._trainer", "a module never attached to a trainer does not hold None there")
    with pytest.raises(RuntimeError, match="not attached"):
        module.trainer  # why the private attribute: the public property raises here
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    module.trainer = trainer
    assert upstream.attached_trainer(module) is trainer, _changed(
        "Lightning", "LightningModule._trainer", "the public trainer setter no longer stores the trainer there")


class HParamsModel(BoringModel):
    """A model that records its hyperparameters, as every mmssl module does."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_lightning_cli_records_the_class_path_in_hparams(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["mmssl"])  # the CLI reads args= only

    cli = LightningCLI(pl.LightningModule, subclass_mode_model=True, run=False, save_config_callback=None,
                       args=["--model=tests.test_upstream.HParamsModel", "--model.width=5",
                             f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"])
    hparams = dict(cli.model.hparams)
    assert upstream.lightning_cli_class_path(hparams) == "tests.test_upstream.HParamsModel", _changed(
        "Lightning", "LightningCLI's hyper_parameters['_class_path']",
        f"a subclass-mode model instantiated by the CLI recorded {sorted(hparams)}, no '_class_path' naming its class "
        "(mmssl.checkpoints.load then falls back to the run's config.yaml)")
    assert hparams.get("width") == 5


class _Averaging(pl.callbacks.WeightAveraging):
    """WeightAveraging whose setup hands it an AveragedModel built here, as mmssl's EMA does."""

    def __init__(self) -> None:
        super().__init__(use_buffers=True)
        self.mine = None

    def setup(self, trainer, pl_module, stage) -> None:
        if stage == "fit":
            from torch.optim.swa_utils import AveragedModel

            self.mine = AveragedModel(pl_module, use_buffers=True)
            upstream.set_weight_averaging_model(self, self.mine)


def test_lightning_weight_averaging_setup_sets_only_the_average():
    callback = pl.callbacks.WeightAveraging(use_buffers=True)
    assert upstream.weight_averaging_model(callback) is None, _changed(
        "Lightning", "WeightAveraging._average_model", "it is not None before fit")
    before = dict(vars(callback))
    callback.setup(pl.Trainer(logger=False, accelerator="cpu"), BoringModel(), "fit")
    after = dict(vars(callback))
    average = upstream.weight_averaging_model(callback)
    assert isinstance(average, torch.optim.swa_utils.AveragedModel), _changed(
        "Lightning", "WeightAveraging.setup", f"on fit it left {type(average).__name__} in _average_model")
    changed = sorted(k for k in after if k not in before or after[k] is not before[k])
    assert changed == ["_average_model"], _changed(
        "Lightning", "WeightAveraging.setup", f"it now sets {changed}: mmssl's EMA.setup, which replaces it, "
        "sets only _average_model")


def test_lightning_weight_averaging_hooks_use_the_average_set():
    callback = _Averaging()
    # One process: what is checked is which set of weights Lightning's training-step hooks average
    # (the EMA validated on 2 ranks, against DDP: tests/checkpoints/test_fsdp2_ema.py).
    trainer = pl.Trainer(max_steps=3, logger=False, callbacks=[callback], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, accelerator="cpu", devices=1)
    module = BoringModel()
    trainer.fit(module)
    average = callback.mine
    assert upstream.weight_averaging_model(callback) is average
    assert int(average.n_averaged) == 3, _changed(
        "Lightning", "WeightAveraging._average_model",
        f"after 3 steps the AveragedModel set there was updated {int(average.n_averaged)} times, not 3")
    averaged = average.module.layer.weight
    assert torch.equal(module.layer.weight, averaged), _changed(
        "Lightning", "WeightAveraging._average_model", "on_train_end no longer copies its weights into the module")
    checkpoint = {"state_dict": {}}
    callback.on_save_checkpoint(trainer, module, checkpoint)
    assert torch.equal(checkpoint["state_dict"]["layer.weight"], averaged), _changed(
        "Lightning", "WeightAveraging._average_model", "on_save_checkpoint no longer saves its weights as state_dict")


def test_an_averaged_model_averages_the_module_set_into_it():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = nn.Linear(3, 2)
    average = AveragedModel(nn.Identity(), use_buffers=True, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    copy = nn.Linear(3, 2)
    upstream.set_averaged_module(average, copy)
    average.update_parameters(model)  # the first update copies
    with torch.no_grad():
        model.weight.add_(2.0)
    average.update_parameters(model)
    assert torch.allclose(copy.weight, model.weight - 1.0), _changed(
        "torch", "AveragedModel.module", "update_parameters no longer averages into the module set there")
    assert set(average.state_dict()) == {"module.weight", "module.bias", "n_averaged"}, _changed(
        "torch", "AveragedModel.module", f"its state_dict is {sorted(average.state_dict())}")


def test_lightning_runs_callback_validation_hooks_before_the_strategys():
    """mmssl's EMA under FSDP2 swaps the model's shards with the average's in on_validation_start,
    before the strategy gathers the model (FSDP2Strategy.on_validation_start), and back in
    on_validation_end, before the strategy frees the gathered copy."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    calls = []

    class Strategy(SingleDeviceStrategy):
        def on_validation_start(self) -> None:
            calls.append("strategy start")

        def on_validation_end(self) -> None:
            calls.append("strategy end")

    class Record(pl.Callback):
        def on_validation_start(self, trainer, pl_module) -> None:
            calls.append("callback start")

        def on_validation_end(self, trainer, pl_module) -> None:
            calls.append("callback end")

    trainer = pl.Trainer(strategy=Strategy(device=torch.device("cpu")), callbacks=[Record()], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    trainer.validate(BoringModel(), verbose=False)
    assert calls == ["callback start", "strategy start", "callback end", "strategy end"], _changed(
        "Lightning", "_EvaluationLoop hook order", f"validation hooks now run as {calls}")


# torch optimizers --------------------------------------------------------------------------------


def test_fused_adam_skips_a_step_on_found_inf():
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    assert upstream.takes_found_inf(optimizer), _changed(
        "torch", "Optimizer._step_supports_amp_scaling", "fused AdamW no longer sets it")
    before = param.detach().clone()
    param.grad = torch.ones(4)
    upstream.set_found_inf(optimizer, torch.ones(()))
    optimizer.step()
    upstream.clear_found_inf(optimizer)
    assert torch.equal(param.detach(), before), _changed(
        "torch", "the fused Adam step's found_inf attribute", "a step with found_inf=1 changed the parameters")
    state = optimizer.state[param]
    assert float(state["step"]) == 0 and not state["exp_avg"].any(), _changed(
        "torch", "the fused Adam step's found_inf attribute",
        f"a skipped first step left step={float(state['step'])} or non-zero moments")
    assert not hasattr(optimizer, "found_inf")
    optimizer.step()  # flag cleared: a real step
    assert not torch.equal(param.detach(), before) and float(optimizer.state[param]["step"]) == 1, _changed(
        "torch", "the fused Adam step's found_inf attribute", "the step after clearing it did not update")
    plain = torch.optim.SGD([param], lr=0.1)
    assert not upstream.takes_found_inf(plain), _changed(
        "torch", "Optimizer._step_supports_amp_scaling", "SGD (not fused) now claims it")


# torch wrappers and norm layers ------------------------------------------------------------------


def _names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()]


def test_torch_compile_and_checkpoint_wrapper_prefixes():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    built = ["0.weight", "0.bias", "1.weight", "1.bias"]
    compiled = torch.compile(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))  # lazy: nothing is compiled here
    assert [upstream.unwrapped_name(n) for n in _names(compiled)] == built, _changed(
        "torch", "torch.compile's OptimizedModule._orig_mod", f"its parameters are named {_names(compiled)}")
    checkpointed = nn.Sequential(checkpoint_wrapper(nn.Linear(3, 3)), nn.Linear(3, 3))
    assert [upstream.unwrapped_name(n) for n in _names(checkpointed)] == built, _changed(
        "torch", "checkpoint_wrapper's _checkpoint_wrapped_module", f"its parameters are named {_names(checkpointed)}")


def test_fsdp_parameter_names():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already up")
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    built = ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    with tempfile.TemporaryDirectory() as root:
        torch.distributed.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}",
                                             rank=0, world_size=1)
        try:
            fsdp1 = FullyShardedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3))),
                                             use_orig_params=True, device_id=torch.device("cpu"),
                                             auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
            names = _names(fsdp1)
            assert any("_fsdp_wrapped_module." in n for n in names) and [
                upstream.unwrapped_name(n) for n in names] == built, _changed(
                "torch", "FSDP 1's _fsdp_wrapped_module", f"its parameters are named {names}")
            fsdp2 = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)))
            fully_shard(fsdp2[1])
            fully_shard(fsdp2)
            assert _names(fsdp2) == built, _changed(
                "torch", "FSDP2's fully_shard", f"it now renames parameters: {_names(fsdp2)}; add its prefix to "
                "mmssl.upstream.WRAPPER_PREFIXES")
        finally:
            torch.distributed.destroy_process_group()


def test_fsdp2_lazy_init_makes_the_root_before_an_inner_block_runs_first():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already up")
    from torch.distributed.fsdp import fully_shard

    def sharded() -> nn.Sequential:
        model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)))
        fully_shard(model[1])
        fully_shard(model)
        return model

    x = torch.randn(2, 3)
    with tempfile.TemporaryDirectory() as root:
        torch.distributed.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}",
                                             rank=0, world_size=1)
        try:
            with torch.no_grad():
                plain = sharded()
                plain[1](x)  # an inner block first: it makes itself a root
                with pytest.raises(RuntimeError, match="root module first"):
                    plain(x)
                model = sharded()
                upstream.fsdp2_lazy_init(model)
                model[1](x)
                assert model(x).shape == (2, 3), _changed(
                    "torch", "FSDPState._lazy_init", "the root still fails after an inner block ran first")
        finally:
            torch.distributed.destroy_process_group()


def test_torch_batch_norms_share_the_private_base():
    from timm.layers import BatchNormAct2d

    norms = [getattr(nn, name)(4) for name in dir(nn) if "BatchNorm" in name and not name.startswith("Lazy")]
    norms += [nn.LazyBatchNorm2d(), BatchNormAct2d(4)]
    assert len(norms) >= 5 and all(upstream.is_batch_norm(m) for m in norms), _changed(
        "torch", "nn.modules.batchnorm._BatchNorm",
        f"not the base of {[type(m).__name__ for m in norms if not upstream.is_batch_norm(m)]}")
    others = [nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4), nn.Linear(4, 4)]
    assert not any(upstream.is_batch_norm(m) for m in others), _changed(
        "torch", "nn.modules.batchnorm._BatchNorm", "a norm without running batch statistics now derives from it")


# torch DistributedDataParallel ---------------------------------------------------------------------


def test_ddp_forward_broadcasts_on_the_two_flags():
    with one_process_group():
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
        x = torch.randn(4, 3)
        with torch.no_grad():
            model(x)
        assert upstream.ddp_buffer_sync_state(model) == (True, False), _changed(
            "torch", "DistributedDataParallel.require_forward_param_sync",
            "a forward without gradients no longer sets it to False")
        model(x)
        assert upstream.ddp_buffer_sync_state(model) == (True, True), _changed(
            "torch", "DistributedDataParallel.require_forward_param_sync",
            "a forward with gradients no longer sets it to True")
        assert model.will_sync_module_buffers(), _changed(
            "torch",
            "DistributedDataParallel.will_sync_module_buffers",
            "the two flags set no longer mean a broadcast",
        )
        upstream.set_ddp_buffer_sync_state(model, (False, True))
        assert not model.will_sync_module_buffers(), _changed(
            "torch", "DistributedDataParallel.broadcast_buffers", "setting it False no longer stops the broadcast")
        upstream.set_ddp_buffer_sync_state(model, (True, False))
        assert not model.will_sync_module_buffers(), _changed(
            "torch", "DistributedDataParallel.require_forward_param_sync",
            "setting it False no longer stops the broadcast")


# open_clip ---------------------------------------------------------------------------------------


def test_open_clip_text_prefix_equals_encode_text():
    import open_clip

    torch.manual_seed(0)
    model = open_clip.CLIP(
        embed_dim=16, vision_cfg=open_clip.CLIPVisionCfg(layers=1, width=16, head_width=8, patch_size=8, image_size=16),
        text_cfg=open_clip.CLIPTextCfg(context_length=12, vocab_size=64, width=16, heads=2, layers=2)).eval()
    eot = 63  # argmax pooling: the highest id ends each caption
    tokens = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate((3, 5, 2)):
        tokens[row, :n] = torch.randint(1, 60, (n,))
        tokens[row, n] = eot
    length = 6  # the longest caption, its end-of-text token included
    with torch.no_grad():
        full = model.encode_text(tokens, normalize=True)
        mine = upstream.open_clip_encode_text_prefix(model, tokens[:, :length], normalize=True)
    assert torch.allclose(mine, full, atol=1e-6), _changed(
        "open_clip", "CLIP.encode_text", "mmssl.upstream.open_clip_encode_text_prefix, a copy of its body for a "
        f"batch shorter than context_length, now differs from it (max difference {(mine - full).abs().max():.2e})")


def test_open_clip_coca_samples_once_its_transformers_globals_are_set(tiny_coca_json):
    from open_clip import coca_model

    assert hasattr(coca_model, "_has_transformers") and isinstance(coca_model.GENERATION_TYPES, dict), _changed(
        "open_clip", "coca_model._has_transformers / GENERATION_TYPES", "the module globals generate() checks are gone")
    upstream.open_clip_coca_sampling()
    upstream.open_clip_coca_sampling()  # idempotent
    open_clip.add_model_config(tiny_coca_json)
    model = open_clip.create_model("coca_test_tiny").eval()
    torch.nn.init.normal_(model.text_decoder.text_projection, std=0.25)  # open_clip leaves it torch.empty
    ids = model.generate(torch.randn(2, 3, 32, 32), generation_type="top_p", top_p=0.9, seq_len=8, min_seq_len=3)
    assert ids.shape[0] == 2 and 2 <= ids.shape[1] <= 8 and (ids[:, 0] == 49406).all(), _changed(
        "open_clip", "CoCa.generate's sampling loop", f"it returned {tuple(ids.shape)} ids")


# timm --------------------------------------------------------------------------------------------


def test_timm_randaugment_ops_apply_aug_fn():
    from PIL import Image
    from timm.data import auto_augment, create_transform

    transform = create_transform(input_size=16, is_training=True, auto_augment="rand-m10-n1-mstd0-inc1")
    seen = []

    def black(image, bits_to_keep, **kwargs):
        seen.append(bits_to_keep)
        return Image.new(image.mode, image.size)

    changed = upstream.replace_timm_augment_fn(transform, auto_augment.posterize, black)
    assert changed == 1, _changed(
        "timm", "RandAugment.ops[i].aug_fn",
        f"create_transform(auto_augment='rand-...-inc1') holds {changed} ops whose aug_fn is timm.data.auto_augment."
        "posterize, not 1")
    (op,) = [aug for t in transform.transforms for aug in getattr(t, "ops", ()) if aug.aug_fn is black]
    op.prob = 1.0
    out = op(Image.new("RGB", (16, 16), (200, 100, 50)))
    assert seen == [0] and out.getextrema() == ((0, 0),) * 3, _changed(
        "timm", "AugmentOp.__call__ / PosterizeIncreasing",
        f"at magnitude 10 the op called aug_fn with bits {seen}, not [0], or ignored its result")


def test_fsdp2_forget_forward_order_empties_the_record_a_backward_prefetches_by():
    from torch.distributed.fsdp import fully_shard

    with one_process_group():
        model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)))
        fully_shard(model[1])
        fully_shard(model)
        with torch.no_grad():
            model(torch.randn(2, 3))
        group = model[1]._get_fsdp_state()._fsdp_param_groups[0]
        assert len(group.comm_ctx.post_forward_order) == 2, _changed(
            "torch", "FSDPParamGroup.comm_ctx.post_forward_order", "a no-grad forward no longer records its units")
        upstream.fsdp2_forget_forward_order(model)
        assert group.comm_ctx.post_forward_order == [] and group._post_forward_indices == []


# transformers ------------------------------------------------------------------------------------


def test_transformers_config_reads_back_the_hub_name_its_config_json_records(tmp_path):
    transformers = pytest.importorskip("transformers")
    tiny = dict(hidden_size=32, intermediate_size=37, num_attention_heads=2, num_hidden_layers=1)
    transformers.CLIPConfig(text_config=tiny, vision_config=dict(tiny, image_size=32, patch_size=8)).save_pretrained(
        tmp_path)

    def origin() -> str:
        return upstream.transformers_config_origin(transformers.CLIPConfig.from_pretrained(tmp_path,
                                                                                           local_files_only=True))

    # A folder this transformers wrote records no origin: the teacher's message then says REPO.
    saved = json.loads((tmp_path / "config.json").read_text())
    assert origin() == saved.get("_name_or_path", ""), _changed(
        "transformers", "PretrainedConfig.name_or_path", f"a saved folder reads back {origin()!r}")
    # A Hub download (config.json written by transformers 4) records the repository.
    (tmp_path / "config.json").write_text(json.dumps({**saved, "_name_or_path": "openai/clip-vit-base-patch32"}))
    assert origin() == "openai/clip-vit-base-patch32", _changed(
        "transformers", "config.json's _name_or_path / PretrainedConfig.name_or_path",
        f"a config.json naming openai/clip-vit-base-patch32 reads back {origin()!r}")
