"""mmssl.callbacks.EMA in process, past what tests/callbacks/test_ema.py reads (#45 item 1): which
weights ``mmssl validate`` loads into which module from a file or (FSDP2) a folder, with the
module's ``strict_loading``; what a resume restores from each checkpoint layout, naming the file;
the averaged copy's ``log``; and the FSDP2 helpers that the 2-process tests
(tests/checkpoints/test_fsdp2_ema.py) reach outside mutmut's view."""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torchmetrics import MeanMetric

import mmssl.callbacks.ema as ema_module
from mmssl.callbacks import EMA
from mmssl.checkpoints.read import AVERAGING_STATE, LIGHTNING_META, RAW_WEIGHTS
from mmssl.checkpoints.sharded import _FOLDER, AVERAGED_WEIGHTS


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros(1))


def _state(value: float) -> dict:
    return {"layer.weight": torch.full((2, 2), value), "layer.bias": torch.full((2,), value),
            "count": torch.full((1,), value)}


def _record_loads(monkeypatch) -> list:
    calls = []

    def load(module, folder, state, strict, **kwargs):
        calls.append((module, folder, state, strict, kwargs))

    monkeypatch.setattr(ema_module, "_load", load)
    return calls


def _ema_file(tmp_path) -> tuple[str, dict]:
    checkpoint = {"state_dict": _state(1.0), RAW_WEIGHTS: _state(2.0), AVERAGING_STATE: {"n_averaged": torch.tensor(3)}}
    path = tmp_path / "ema.ckpt"
    torch.save(checkpoint, path)
    return str(path), checkpoint


@pytest.mark.parametrize("strict", [True, False])
def test_validate_loads_a_files_weights_as_evaluate_says_with_the_modules_strict_loading(tmp_path, monkeypatch,
                                                                                         strict):
    path, checkpoint = _ema_file(tmp_path)
    trainer = types.SimpleNamespace(ckpt_path=path, strategy=object())
    for evaluate, want in (("ema", "state_dict"), ("raw", RAW_WEIGHTS)):
        calls = _record_loads(monkeypatch)
        module = _Tiny()
        module.strict_loading = strict
        EMA(evaluate=evaluate)._validate_checkpoint(trainer, module)
        [(into, folder, state, strict_given, _)] = calls
        assert into is module and folder is None and strict_given is strict
        assert all(torch.equal(state[k], v) for k, v in checkpoint[want].items())
    calls = _record_loads(monkeypatch)
    module = _Tiny()
    module.strict_loading = strict
    ema = EMA(evaluate="both")
    ema._validate_checkpoint(trainer, module)
    (copy, folder, averaged, strict_copy, _), (into, raw_folder, raw, strict_raw, _) = calls
    assert copy is ema.averaged_module() and copy is not module and into is module
    assert copy.trainer is trainer and not copy.training  # attached: it runs validation code
    assert folder is None and raw_folder is None and strict_copy is strict and strict_raw is strict
    assert torch.equal(averaged["layer.weight"], checkpoint["state_dict"]["layer.weight"])
    assert torch.equal(raw["layer.weight"], checkpoint[RAW_WEIGHTS]["layer.weight"])


def test_validate_loads_a_folders_average_under_fsdp2_and_leaves_its_raw_weights(tmp_path, monkeypatch):
    """Under FSDP2 the strategy has loaded the folder's raw weights: ``ema`` loads the folder's
    average into the model, ``raw`` nothing, ``both`` the average into a copy."""
    folder = tmp_path / "step=2.ckpt"
    folder.mkdir()
    torch.save({AVERAGING_STATE: {"n_averaged": torch.tensor(3)}, "state_dict": {}}, folder / LIGHTNING_META)
    trainer = types.SimpleNamespace(ckpt_path=folder, strategy=ModelParallelStrategy())
    module = _Tiny()
    for evaluate, count in (("ema", 1), ("raw", 0), ("both", 1)):
        calls = _record_loads(monkeypatch)
        ema = EMA(evaluate=evaluate)
        ema._validate_checkpoint(trainer, module)
        assert len(calls) == count, evaluate
        if count:
            into, where, state, _, _ = calls[0]
            assert into is (module if evaluate == "ema" else ema.averaged_module()) and where == str(folder)
            assert state is None if evaluate == "ema" else state == {}
    # A file under FSDP2 is read as a file.
    path, _ = _ema_file(tmp_path)
    calls = _record_loads(monkeypatch)
    EMA(evaluate="ema")._validate_checkpoint(types.SimpleNamespace(ckpt_path=path, strategy=ModelParallelStrategy()),
                                             module)
    assert calls[0][1] is None and calls[0][2] is not None
    # A folder without an average is refused naming it.
    torch.save({"state_dict": {}}, folder / LIGHTNING_META)
    with pytest.raises(ValueError) as err:
        EMA(evaluate="ema")._validate_checkpoint(trainer, module)
    assert str(err.value) == (f"EMA: init_args.evaluate='ema' needs --ckpt_path of a checkpoint trained with "
                              f"mmssl.callbacks.EMA; {folder}: no averaged weights (no '{RAW_WEIGHTS}'): set "
                              "evaluate: raw or drop the callback")


def test_validate_without_a_checkpoint_is_refused_unless_raw(monkeypatch):
    trainer = types.SimpleNamespace(ckpt_path=None, strategy=object())
    calls = _record_loads(monkeypatch)
    with pytest.raises(ValueError) as err:
        EMA(evaluate="both")._validate_checkpoint(trainer, _Tiny())
    assert str(err.value).endswith(f"EMA; no checkpoint: no averaged weights (no '{RAW_WEIGHTS}'): set evaluate: "
                                   "raw or drop the callback")
    EMA(evaluate="raw")._validate_checkpoint(trainer, _Tiny())
    assert calls == []


def test_validate_refuses_a_file_with_an_averaging_count_but_no_raw_weights(tmp_path, monkeypatch):
    """Its ``state_dict`` is not known to be the average (a folder consolidated without it)."""
    path = tmp_path / "odd.ckpt"
    torch.save({"state_dict": _state(1.0), AVERAGING_STATE: {"n_averaged": torch.tensor(3)}}, path)
    calls = _record_loads(monkeypatch)
    with pytest.raises(ValueError, match="no averaged weights"):
        EMA(evaluate="ema")._validate_checkpoint(types.SimpleNamespace(ckpt_path=path, strategy=object()), _Tiny())
    assert calls == []


def _fitted(tmp_path) -> tuple[EMA, pl.Trainer, _Tiny]:
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path)
    trainer.ckpt_path = str(tmp_path / "last.ckpt")
    module = _Tiny()
    ema = EMA()
    ema.setup(trainer, module, "fit")
    return ema, trainer, module


def test_a_resume_restores_each_layouts_average_naming_the_file(tmp_path, monkeypatch):
    ema, trainer, module = _fitted(tmp_path)
    path = str(tmp_path / "last.ckpt")
    count = {"n_averaged": torch.tensor(5)}
    # WeightAveraging's own layout: the average in state_dict, the raw weights loaded into the model.
    calls = _record_loads(monkeypatch)
    ema.on_load_checkpoint(trainer, module, {"state_dict": _state(1.0), RAW_WEIGHTS: _state(2.0),
                                             AVERAGING_STATE: count})
    (into, _, raw, strict_raw, _), (average, folder, averaged, strict, kwargs) = calls
    assert into is module and raw["count"].item() == 2.0 and strict_raw is True
    assert average is ema.averaged_module() and folder is None and averaged["count"].item() == 1.0
    assert strict is True and kwargs == {"fill_from": module, "where": path}
    assert int(ema._average_model.n_averaged) == 5
    # A sharded folder: the average is loaded from it, shard by shard.
    calls = _record_loads(monkeypatch)
    ema.on_load_checkpoint(trainer, module, {_FOLDER: "the/folder", AVERAGING_STATE: {"n_averaged": torch.tensor(6)}})
    [(average, folder, averaged, _, kwargs)] = calls
    assert average is ema.averaged_module() and folder == "the/folder" and averaged is None and kwargs["where"] == path
    # A consolidated folder without its average: refused naming the file.
    with pytest.raises(ValueError) as err:
        ema.on_load_checkpoint(trainer, module, {"state_dict": {}, AVERAGING_STATE: count})
    assert str(err.value) == (f"EMA: {path} holds an EMA ('{AVERAGING_STATE}'), but its averaged weights were not "
                              "read (a sharded checkpoint folder consolidated without them): resume it under FSDP2, "
                              "or read it with a reader that keeps its 'averaged_state_dict'")
    # raw_first's layout.
    calls = _record_loads(monkeypatch)
    ema.on_load_checkpoint(trainer, module, {AVERAGED_WEIGHTS: _state(4.0), "state_dict": _state(2.0),
                                             AVERAGING_STATE: count})
    [(average, _, averaged, _, _)] = calls
    assert averaged["count"].item() == 4.0


def test_a_resume_from_a_checkpoint_without_an_ema_starts_the_average_from_the_model(tmp_path):
    ema, trainer, module = _fitted(tmp_path)
    with torch.no_grad():
        module.layer.weight.fill_(3.0)
        module.count.fill_(7.0)
    with pytest.warns(UserWarning, match=f"^EMA: {tmp_path / 'last.ckpt'} was not written with an EMA: the average"):
        ema.on_load_checkpoint(trainer, module, {"state_dict": module.state_dict()})
    average = ema.averaged_module()
    assert torch.equal(average.layer.weight, module.layer.weight) and average.count.item() == 7.0


def test_the_copys_log_writes_the_modules_key_with_the_suffix_and_computes_metrics():
    logged = []

    class Module:
        def log(self, name, value, *args, sync_dist=False, **kwargs):
            logged.append((name, value, args, sync_dist, kwargs))

    log = ema_module._SuffixedLog(Module())
    log("val/loss", 0.5, True, on_epoch=True)
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 3.0]))
    log("val/top1", metric, metric_attribute="top1")
    assert logged[0] == ("val/loss_ema", 0.5, (True,), False, {"on_epoch": True})
    name, value, args, sync_dist, kwargs = logged[1]
    assert (name, float(value), args, sync_dist, kwargs) == ("val/top1_ema", 2.0, (), True, {})
    assert metric.update_count == 0  # reset, as Lightning does for the module's own


def test_fsdp2_helpers_pair_gather_and_swap_in_order():
    assert ema_module._gathers(types.SimpleNamespace(strategy=types.SimpleNamespace(gather_for_evaluation=True)))
    assert ema_module._gathers(types.SimpleNamespace(strategy=types.SimpleNamespace(gather_for_evaluation=1))) is True
    assert not ema_module._gathers(types.SimpleNamespace(strategy=types.SimpleNamespace()))
    a, b = _Tiny(), _Tiny()
    pairs = ema_module._pairs(a, b)  # parameters, then buffers, as AveragedModel pairs them
    assert len(pairs) == 3
    assert all(x is p and y is q for (x, y), p, q in zip(pairs, [a.layer.weight, a.layer.bias, a.count],
                                                          [b.layer.weight, b.layer.bias, b.count]))
    before_a, before_b = a.layer.weight.clone(), b.layer.weight.clone()
    ema_module._exchange(pairs)
    assert torch.equal(a.layer.weight, before_b) and torch.equal(b.layer.weight, before_a)


def test_load_checks_keys_past_frozen_tensors_and_fills_them_from_the_model():
    module = _Tiny()
    module.layer.bias.requires_grad_(False)
    state = _state(1.0)
    with pytest.raises(RuntimeError, match="count"):  # strict: every key, buffers included
        ema_module._load(module, None, {k: v for k, v in state.items() if k != "count"}, True)
    source = _Tiny()
    with torch.no_grad():
        source.count.fill_(9.0)
    # Not strict (LoRA): frozen parameters and buffers may be missing, taken from fill_from.
    ema_module._load(module, None, {"layer.weight": state["layer.weight"]}, False, fill_from=source)
    assert module.count.item() == 9.0 and torch.equal(module.layer.bias, source.layer.bias)
    ema_module._load(module, None, {"layer.weight": state["layer.weight"]}, False)  # nothing to fill from
    with pytest.raises(KeyError) as err:
        ema_module._load(module, None, {"layer.bias": state["layer.bias"]}, False)
    assert err.value.args[0] == ("EMA: the checkpoint: the averaged weights do not fit the model: missing "
                                 "['layer.weight'], unknown []")
    many = torch.nn.ModuleDict({f"l{i}": torch.nn.Linear(1, 1) for i in range(5)})
    with pytest.raises(KeyError) as err:
        ema_module._load(many, None, {f"x{i}": torch.zeros(1) for i in range(5)}, False, where="a.ckpt")
    assert err.value.args[0] == ("EMA: a.ckpt: the averaged weights do not fit the model: missing ['l0.weight', "
                                 "'l0.bias', 'l1.weight'], unknown ['x0', 'x1', 'x2']")


def test_load_reads_a_folder_or_scatters_into_a_sharded_module(monkeypatch):
    calls = []
    monkeypatch.setattr(ema_module, "load_averaged_weights", lambda folder, module: calls.append((folder, module)))
    module = _Tiny()
    ema_module._load(module, "the/folder", None, True)
    assert calls == [("the/folder", module)]
    monkeypatch.setattr(ema_module, "is_fsdp2", lambda m: m is module)
    monkeypatch.setattr(ema_module, "load_full_state", lambda m, s, strict: calls.append((m, s, strict)))
    state = _state(1.0)
    ema_module._load(module, None, state, False)
    assert calls[1] == (module, state, False)


def test_a_fsdp2_file_checkpoint_gets_the_whole_average_and_a_folder_its_shards(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.state_dict as dcp_state

    ema, _, module = _fitted(tmp_path)
    got = []

    def whole(average, options):
        got.append((average, options.full_state_dict, options.cpu_offload))
        return {"whole": True}

    monkeypatch.setattr(dcp_state, "get_model_state_dict", whole)
    for strategy in (object(), ModelParallelStrategy(), types.SimpleNamespace()):
        checkpoint = {"state_dict": module.state_dict()}
        ema.on_save_checkpoint(types.SimpleNamespace(strategy=strategy), module, checkpoint)
        assert checkpoint["state_dict"] != {"whole": True} and RAW_WEIGHTS in checkpoint
    strategy = ModelParallelStrategy()
    for sharded, written in ((True, False), (False, True)):
        strategy.sharded_checkpoints = sharded
        checkpoint = {"state_dict": module.state_dict()}
        ema.on_save_checkpoint(types.SimpleNamespace(strategy=strategy), module, checkpoint)
        assert (checkpoint["state_dict"] == {"whole": True}) is written
    assert got == [(ema.averaged_module(), True, True)]
    outside = EMA()  # outside fit: Lightning's layout, nothing gathered
    checkpoint = {"state_dict": module.state_dict()}
    outside.on_save_checkpoint(types.SimpleNamespace(strategy=strategy), module, checkpoint)
    assert RAW_WEIGHTS not in checkpoint and len(got) == 1


def test_fsdp2_fit_swaps_the_average_in_for_validation_and_back(tmp_path):
    ema, _, module = _fitted(tmp_path)
    with torch.no_grad():
        module.layer.weight.fill_(5.0)
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(fn="fit"), strategy=ModelParallelStrategy(),
                                    sanity_checking=False)
    average = ema.averaged_module().layer.weight.clone()
    ema.on_validation_start(trainer, module)
    assert torch.equal(module.layer.weight, average)
    ema.on_validation_end(trainer, module)
    assert (module.layer.weight == 5.0).all()


class _Recorder:
    def __init__(self) -> None:
        self.calls = []

    def on_validation_epoch_start(self):
        self.calls.append("start")

    def validation_step(self, *args):
        self.calls.append(("step", *args))

    def on_validation_epoch_end(self):
        self.calls.append("end")


class _Evaluator:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def evaluate(self):  # an evaluation callback (ZeroShot, LinearProbe, KNNProbe)
        raise AssertionError("not called here")

    def on_validation_epoch_end(self, trainer, module):
        self.calls.append(("evaluator", trainer, module))


class _Other:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def on_validation_epoch_end(self, trainer, module):
        self.calls.append(("other", trainer, module))


def test_both_runs_the_copys_validation_and_every_evaluation_callback_outside_the_sanity_check():
    import contextlib

    for evaluate in ema_module.EVALUATE:
        ema = EMA(evaluate=evaluate)
        module = ema._copy = _Recorder()
        trainer = types.SimpleNamespace(sanity_checking=False, strategy=object(), num_val_batches=[3],
                                        precision_plugin=types.SimpleNamespace(val_step_context=contextlib.nullcontext))
        trainer.callbacks = [ema, _Evaluator(module.calls), _Other(module.calls)]
        ema.on_validation_epoch_start(trainer, None)
        ema.on_validation_batch_end(trainer, None, None, "batch", 2)
        trainer.num_val_batches = [3, 4]  # two validation loaders: the loader's index too
        ema.on_validation_batch_end(trainer, None, None, "batch", 5)
        ema.on_validation_batch_end(trainer, None, None, "batch", 6, 1)
        ema.on_validation_epoch_end(trainer, None)
        if evaluate != "both":
            assert module.calls == [], evaluate
            continue
        assert module.calls == ["start", ("step", "batch", 2), ("step", "batch", 5, 0), ("step", "batch", 6, 1), "end",
                                ("evaluator", trainer, module)]
        module.calls.clear()
        trainer.sanity_checking = True
        ema.on_validation_epoch_start(trainer, None)
        ema.on_validation_batch_end(trainer, None, None, "batch", 2)
        ema.on_validation_epoch_end(trainer, None)
        assert module.calls == []
    ema = EMA(evaluate="both")  # no averaged copy (a sanity check of mmssl validate before its load)
    trainer.sanity_checking = False
    ema.on_validation_epoch_start(trainer, None)
    ema.on_validation_batch_end(trainer, None, None, "batch", 2)
    ema.on_validation_epoch_end(trainer, None)


def test_fsdp2_both_gathers_the_average_for_a_gathered_evaluation_and_reshards_it(tmp_path, monkeypatch):
    from lightning.pytorch.trainer.states import TrainerFn

    calls = []
    monkeypatch.setattr(ema_module, "gather_module", lambda module: calls.append(("gather", module)))
    monkeypatch.setattr(ema_module, "reshard_module", lambda module, after: calls.append(("reshard", module, after)))
    ema, _, module = _fitted(tmp_path)
    ema.evaluate = "both"
    average = ema.averaged_module()
    strategy = ModelParallelStrategy()
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(fn=TrainerFn.FITTING), strategy=strategy,
                                    sanity_checking=False)
    for gathers, sanity in ((False, False), (True, True)):
        strategy.gather_for_evaluation, trainer.sanity_checking = gathers, sanity
        ema.on_validation_start(trainer, module)
        ema.on_validation_end(trainer, module)
    assert calls == []
    strategy.gather_for_evaluation, trainer.sanity_checking = True, False
    ema.on_validation_start(trainer, module)
    assert calls == [("gather", average)] and ema._gathered is True
    ema.on_validation_end(trainer, module)
    assert calls[1] == ("reshard", average, True) and ema._gathered is False
    strategy.policy = types.SimpleNamespace(reshard_after_forward=False)
    ema.on_validation_start(trainer, module)
    ema.on_validation_end(trainer, module)
    assert calls[3] == ("reshard", average, False)
    # evaluate: ema in mmssl validate: the weights were loaded, nothing is swapped.
    ema.evaluate = "ema"
    monkeypatch.setattr(ema, "_validate_checkpoint", lambda trainer, pl_module: None)
    trainer.state.fn = TrainerFn.VALIDATING
    with torch.no_grad():
        module.layer.weight.fill_(5.0)
    ema.on_validation_start(trainer, module)
    assert (module.layer.weight == 5.0).all() and ema._swapped == []
    ema._copy = copy = _Tiny()
    ema.on_validation_end(trainer, module)
    assert len(calls) == 4 and ema._copy is None  # mmssl validate's copy let go
    trainer.state.fn = TrainerFn.FITTING
    ema._copy = copy
    ema.on_validation_end(trainer, module)
    assert ema._copy is copy


def test_ema_ends_fit_with_the_average_resharding_an_fsdp2_model_first(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(ema_module, "reshard_module", lambda module, after: calls.append((module, after)))
    for strategy, after in ((object(), None), (ModelParallelStrategy(), True), (ModelParallelStrategy(), False)):
        if after is False:
            strategy.policy = types.SimpleNamespace(reshard_after_forward=False)
        ema, _, module = _fitted(tmp_path)
        with torch.no_grad():
            ema.averaged_module().layer.weight.fill_(2.0)
            ema.averaged_module().count.fill_(4.0)
        ema.on_train_end(types.SimpleNamespace(strategy=strategy), module)
        assert (module.layer.weight == 2.0).all() and module.count.item() == 4.0
        assert calls[-1:] == ([] if after is None else [(module, after)])
    for evaluate in ("raw", "both"):
        ema, _, module = _fitted(tmp_path)
        ema.evaluate = evaluate
        with torch.no_grad():
            ema.averaged_module().layer.weight.fill_(2.0)
        ema.on_train_end(types.SimpleNamespace(strategy=ModelParallelStrategy()), module)
        assert not (module.layer.weight == 2.0).all()
    assert len(calls) == 2


def test_the_warmup_decay_follows_the_step_before_the_update_with_its_gamma(monkeypatch):
    from lightning.pytorch.callbacks import WeightAveraging

    monkeypatch.setattr(WeightAveraging, "on_train_batch_end", lambda *args: None)
    ema = EMA(decay=0.99, warmup_power=1.0, warmup_gamma=4.0)
    ema.on_train_batch_end(types.SimpleNamespace(global_step=5), None, None, None, 0)
    assert ema._decay_now == pytest.approx(1 - (1 + 4 / 4.0) ** -1.0)  # step 4: 0.5
    assert ema_module.ema_decay(0.99, 4, 1.0, 4.0) == pytest.approx(0.5)


def test_the_copy_shares_the_trainer_the_device_mesh_and_the_modules_factories():
    import functools
    import threading

    module = _Tiny()
    module._device_mesh = mesh = types.SimpleNamespace(name="mesh")
    module.layer.factory = factory = functools.partial(print, threading.Lock())  # cannot be deep-copied
    # Lightning's __getstate__ drops the module's own _trainer, but parts of a run refer to the
    # trainer too, and its loops hold live data-loader iterators (a generator cannot be deep-copied):
    # validate's copy under evaluate: both failed on it.
    trainer = types.SimpleNamespace(iterator=(x for x in range(3)))
    module.layer.run = types.SimpleNamespace(trainer=trainer)
    copy = ema_module._copy(module, trainer)
    assert copy.device_mesh is mesh and copy.layer.factory is factory and copy.layer.run.trainer is trainer
    assert copy.layer.weight is not module.layer.weight and torch.equal(copy.layer.weight, module.layer.weight)


def test_local_takes_a_dtensors_shard_and_leaves_a_tensor():
    class Sharded:
        def to_local(self):
            return "the shard"

    tensor = torch.zeros(1)
    assert ema_module._local(Sharded()) == "the shard" and ema_module._local(tensor) is tensor


def test_fsdp2_prepare_shards_the_copy_on_the_trainer_then_attaches_it(tmp_path, monkeypatch):
    seen = []

    class Sharded(_Tiny):
        def configure_model(self):
            seen.append(("configure", self, self._trainer))

    monkeypatch.setattr(ema_module, "fsdp2_lazy_init", lambda module: seen.append(("lazy", module)))
    ema, trainer, module = _fitted(tmp_path)
    assert ema.averaged_module().trainer is trainer  # attached in setup
    fake = types.SimpleNamespace(strategy=ModelParallelStrategy())
    copy, model = Sharded(), Sharded()
    ema._prepare(copy, fake, model)
    assert seen == [("configure", copy, fake), ("lazy", copy), ("configure", model, None)]
    assert copy.trainer is fake and not copy.training


def test_setup_refuses_fsdp1_and_a_presharded_model_and_configures_the_model_before_its_copy(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ValueError) as err:
        EMA().setup(types.SimpleNamespace(strategy=FSDPStrategy()), _Tiny(), "fit")
    assert str(err.value) == ("EMA: FSDPStrategy (FSDP 1) shards the weights and WeightAveraging keeps a whole copy on "
                              "every device: use EMA with FSDP2 (configs/trainer/fsdp2.yaml), DDP or one device")
    fsdp2 = types.SimpleNamespace(strategy=ModelParallelStrategy())
    EMA(evaluate="raw").setup(fsdp2, _Tiny(), "validate")  # FSDP2 is no FSDP 1
    monkeypatch.setattr(ema_module, "is_fsdp2", lambda module: isinstance(module, _Tiny))
    with pytest.raises(ValueError) as err:
        EMA().setup(fsdp2, _Tiny(), "fit")
    assert str(err.value) == ("EMA: _Tiny was sharded before the EMA callback's setup: the average is copied from the "
                              "unsharded model and sharded as it is")
    seen = []

    class Configured(_Tiny):
        def configure_model(self):
            seen.append(self)

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    model = Configured()
    EMA().setup(trainer, model, "fit")  # is_fsdp2 says True, but no FSDP2 strategy: set up as usual
    assert seen == [model]  # the layers exist before the copy is made
    # Under FSDP2 the copy is made before either is configured (sharded): the copy, then the model.
    monkeypatch.setattr(ema_module, "is_fsdp2", lambda module: False)
    monkeypatch.setattr(ema_module, "fsdp2_lazy_init", lambda module: None)
    seen.clear()
    ema = EMA()
    ema.setup(types.SimpleNamespace(strategy=ModelParallelStrategy()), model, "fit")
    assert seen == [ema.averaged_module(), model]


def test_fsdp2_validate_of_both_prepares_a_copy_of_the_model(monkeypatch):
    fsdp2 = types.SimpleNamespace(strategy=ModelParallelStrategy())
    prepared = []
    for stage, evaluate in (("validate", "both"), ("validate", "ema"), ("test", "both")):
        ema = EMA(evaluate=evaluate)
        monkeypatch.setattr(ema, "_prepare", lambda *args: prepared.append(args))
        model = _Tiny()
        ema.setup(fsdp2, model, stage)
        if (stage, evaluate) != ("validate", "both"):
            assert ema._copy is None
            continue
        [(copy, trainer, pl_module)] = prepared
        assert copy is ema._copy and copy is not model and torch.equal(copy.layer.weight, model.layer.weight)
        assert trainer is fsdp2 and pl_module is model
    assert len(prepared) == 1


def test_defaults_and_each_refusals_message():
    ema = EMA()
    assert (ema.decay, ema.warmup_power, ema.warmup_gamma, ema.update_every_n_steps, ema.evaluate) == (
        0.999, None, 1.0, 1, "ema")
    where = "(its trainer.callbacks entry)"
    for kwargs, message in (
            ({"decay": 1.0}, f"EMA: init_args.decay {where} must be in (0, 1), got 1.0"),
            ({"warmup_power": -1.0},
             f"EMA: init_args.warmup_power {where} must be > 0 (or null: no warm-up), got -1.0"),
            ({"warmup_gamma": 0.0}, f"EMA: init_args.warmup_gamma {where} must be > 0, got 0.0"),
            ({"update_every_n_steps": 0}, f"EMA: init_args.update_every_n_steps {where} must be >= 1, got 0"),
            ({"evaluate": "x"}, f"EMA: init_args.evaluate {where} must be one of ('raw', 'ema', 'both'), got 'x'")):
        with pytest.raises(ValueError) as err:
            EMA(**kwargs)
        assert str(err.value) == message
