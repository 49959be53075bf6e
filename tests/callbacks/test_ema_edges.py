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
