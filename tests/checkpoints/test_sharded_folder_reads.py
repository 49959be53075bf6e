"""A sharded checkpoint folder (DCP, as an FSDP2 run writes it) is read in this process as the
checkpoint a DDP run would have saved, and as data only.

The folders here are written in this process with ``torch.distributed.checkpoint.save`` in the
layout of ``FSDP2Strategy.save_checkpoint`` (``state_dict``, the EMA's average, ``optimizer_<i>``
as ``get_optimizer_state_dict`` gives them, then Lightning's ``meta.pt``), so every branch of the
reader runs without the 2-process runs of ``tests/checkpoints/test_fsdp2*.py``. What users rely
on: the weights with their dtypes, open_clip's 0-d scalars 0-d again (and nothing else reshaped),
the raw weights and the average where a DDP file keeps them, every optimizer's state numbered as
``Optimizer.state_dict()`` numbers it, in the optimizers' order, with nested lists and empty
states as saved; ``load_dcp`` filling a nested state in place; and a folder that pickles code in
``.metadata`` or in a shard refused with a message that names it, nothing of it run.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from mmssl.checkpoints.read import (
    AVERAGED_WEIGHTS,
    RAW_WEIGHTS,
    UnsafeCheckpointError,
    checkpoint_exists,
    has_averaged_weights,
    is_dcp_folder,
    load_dcp,
    read_checkpoint,
    read_dcp_folder,
    read_dcp_metadata,
    read_state_dict,
)


class _Tiny(nn.Module):
    """A linear layer, a 1-element vector that is not a scalar, and a CLIP-like ``logit_scale``
    (0-d in open_clip, (1,) in the sharded module), with a float16 and an int64 buffer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(3, 4, generator=gen))
        self.one = nn.Parameter(torch.tensor([0.5 + seed]))
        self.logit_scale = nn.Parameter(torch.tensor([2.0 + seed]))
        self.register_buffer("fp16", torch.arange(3, dtype=torch.float16) + seed)
        self.register_buffer("count", torch.tensor([7 + seed, 8], dtype=torch.int64))

    def loss(self) -> torch.Tensor:
        return self.lin(torch.ones(2, 4)).sum() + (self.one * self.logit_scale).sum()


def _stepped(model: _Tiny, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model.loss().backward()
    optimizer.step()


def _save(folder: Path, state: dict, meta: dict | None) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    if meta is not None:
        torch.save(meta, folder / "meta.pt")
    return folder


def _custom_state() -> dict:
    """An optimizer that keeps a Python number and nested lists of tensors per parameter (its
    ``lin.weight`` group second, so the numbering crosses groups)."""
    return {
        "state": {
            "logit_scale": {"step": 4, "sum": torch.tensor([1.5]), "pair": [torch.tensor([2.5]), torch.ones(2)]},
            "lin.weight": {"history": [[torch.zeros(2), torch.ones(2)], [torch.full((3,), 2.0)]]},
        },
        "param_groups": [{"lr": 0.25, "params": ["logit_scale", "one"]}, {"lr": 0.5, "params": ["lin.weight"]}],
    }


def _sharded_run(tmp_path: Path, ema: bool = False):
    """A model and its optimizers after one step, and the folder a sharded save of them writes:
    AdamW, a custom optimizer, then 10 plain SGDs (no per-parameter state) with lr 0.01 ... 0.10,
    so optimizer_10 and optimizer_11 sort after optimizer_9."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _Tiny()
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    _stepped(model, adamw)
    state = {"state_dict": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, adamw),
             "optimizer_1": _custom_state()}
    for i in range(2, 12):
        state[f"optimizer_{i}"] = {"state": {}, "param_groups": [{"lr": i / 100, "params": ["one"]}]}
    meta = {"global_step": 5, "scalar_keys": ["logit_scale"]}
    averaged = None
    if ema:
        averaged = _Tiny(seed=1).state_dict()
        state[AVERAGED_WEIGHTS] = averaged
        meta["averaging_state"] = {"n_averaged": torch.tensor(5)}
    folder = _save(tmp_path / "last.ckpt", state, meta)
    return model, adamw, averaged, folder


def _assert_same(got, want) -> None:
    """Equal values, types, dtypes and shapes, through dicts, lists and tuples."""
    assert isinstance(got, dict) if isinstance(want, dict) else type(got) is type(want), (got, want)
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same(a, b)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (got, want)
    else:
        assert got == want


def _as_open_clip(state: dict) -> dict:
    return {k: v.reshape(()) if k == "logit_scale" else v for k, v in state.items()}


def test_a_folder_reads_as_the_checkpoint_a_ddp_run_saves(tmp_path):
    model, adamw, _, folder = _sharded_run(tmp_path)
    checkpoint = read_checkpoint(str(folder))
    assert checkpoint["global_step"] == 5 and RAW_WEIGHTS not in checkpoint
    # The weights as saved, dtypes kept; the scalar 0-d again, the 1-element vector left (1,).
    _assert_same(checkpoint["state_dict"], _as_open_clip(model.state_dict()))
    assert checkpoint["state_dict"]["one"].shape == (1,)
    # Every optimizer in its order (optimizer_10 after optimizer_9), numbered as Optimizer.state_dict().
    states = checkpoint["optimizer_states"]
    assert [group["lr"] for state in states[2:] for group in state["param_groups"]] == [i / 100 for i in range(2, 12)]
    want = adamw.state_dict()
    scalar = list(dict(model.named_parameters())).index("logit_scale")
    want["state"][scalar] = {k: v.reshape(()) for k, v in want["state"][scalar].items()}
    _assert_same(states[0], want)
    # Parameters numbered across groups; a Python number, nested lists and a vector kept as saved.
    _assert_same(states[1], {
        "state": {0: {"step": 4, "sum": torch.tensor(1.5), "pair": [torch.tensor([2.5]), torch.ones(2)]},
                  2: {"history": [[torch.zeros(2), torch.ones(2)], [torch.full((3,), 2.0)]]}},
        "param_groups": [{"lr": 0.25, "params": [0, 1]}, {"lr": 0.5, "params": [2]}],
    })
    # An optimizer without per-parameter state (plain SGD): its groups, no state.
    _assert_same(states[2], {"state": {}, "param_groups": [{"lr": 0.02, "params": [0]}]})
    assert read_state_dict(str(folder)).keys() == model.state_dict().keys()


def test_a_folder_with_an_average_reads_in_weight_averagings_layout(tmp_path):
    model, _, averaged, folder = _sharded_run(tmp_path, ema=True)
    checkpoint = read_checkpoint(str(folder))
    assert has_averaged_weights(checkpoint)
    _assert_same(checkpoint["state_dict"], _as_open_clip(averaged))  # the average, as WeightAveraging saves it
    _assert_same(checkpoint[RAW_WEIGHTS], _as_open_clip(model.state_dict()))
    _assert_same(read_state_dict(str(folder)), _as_open_clip(model.state_dict()))
    _assert_same(read_state_dict(str(folder), ema=True), _as_open_clip(averaged))


def test_a_folder_without_lightnings_meta_is_refused_naming_it(tmp_path):
    """Every sharded save writes meta.pt (the model's class, hyper-parameters, step): a folder without
    it is a partial copy, refused by the one reader for every caller (its weights alone built a
    default model in export, load_model and the evaluation loader)."""
    model = _Tiny()
    folder = _save(tmp_path / "weights", {"state_dict": model.state_dict()}, meta=None)
    with pytest.raises(FileNotFoundError) as err:
        read_dcp_folder(str(folder))
    assert str(err.value).startswith(f"{folder}: ") and "meta.pt" in str(err.value)


def test_load_dcp_fills_a_nested_state_in_place_with_the_folders_values(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, adamw, _, folder = _sharded_run(tmp_path)
    fresh = _Tiny(seed=3)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.7)
    _stepped(fresh, optimizer)  # its state has every entry, with other values
    state = {"state_dict": fresh.state_dict(), "optimizer_0": get_optimizer_state_dict(fresh, optimizer)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_dcp(str(folder), state)
    _assert_same(state["state_dict"], model.state_dict())
    want = get_optimizer_state_dict(model, adamw)
    _assert_same(state["optimizer_0"], want)  # the tensors, and lr etc. (non-tensor entries) too
    assert state["optimizer_0"]["param_groups"][0]["lr"] == 0.1


def test_only_a_folder_with_dcp_metadata_is_a_sharded_checkpoint(tmp_path):
    folder = _save(tmp_path / "last.ckpt", {"state_dict": {"w": torch.ones(2)}}, meta=None)
    assert is_dcp_folder(str(folder)) and checkpoint_exists(str(folder))
    (tmp_path / "empty").mkdir()
    assert not is_dcp_folder(str(tmp_path / "empty")) and not checkpoint_exists(str(tmp_path / "empty"))
    assert not checkpoint_exists(str(tmp_path / "missing.ckpt"))
    torch.save({"state_dict": {}}, tmp_path / "file.ckpt")
    assert checkpoint_exists(str(tmp_path / "file.ckpt")) and not is_dcp_folder(str(tmp_path / "file.ckpt"))


def test_a_folder_without_metadata_or_with_unreadable_metadata_is_named_with_the_reason(tmp_path):
    (tmp_path / "torn").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        read_dcp_metadata(str(tmp_path / "torn"))
    assert str(err.value) == (f"{tmp_path / 'torn'}: no .metadata: not a complete sharded checkpoint "
                              "(torch.distributed.checkpoint writes it last)")
    folder = _save(tmp_path / "last.ckpt", {"state_dict": {"w": torch.ones(2)}}, meta=None)
    (folder / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ValueError) as err:
        read_dcp_metadata(str(folder))
    assert str(err.value).startswith(f"{folder / '.metadata'}: unreadable DCP metadata (UnpicklingError: ")


class _Boom:
    """Pickles a call of ``os.system`` (it would leave ``pwned`` in the working folder)."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_naming_any_other_torch_global_is_refused_with_the_full_message(tmp_path):
    folder = _save(tmp_path / "last.ckpt", {"state_dict": {"w": torch.ones(2)}}, meta=None)
    # torch.zeros(3) as a pickle: GLOBAL "torch zeros", the argument 3, REDUCE.
    (folder / ".metadata").write_bytes(b"\x80\x02ctorch\nzeros\nK\x03\x85R.")
    with pytest.raises(UnsafeCheckpointError) as err:
        read_checkpoint(str(folder))
    assert str(err.value) == (f"{folder / '.metadata'}: refused to load: it pickles torch.zeros, which a DCP "
                              "metadata file never holds (nothing of it was run)")


def test_a_shard_entry_that_pickles_code_is_refused_and_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = _save(tmp_path / "last.ckpt", {"state_dict": {"w": torch.ones(2)}, "optimizer_0": {
        "state": {}, "param_groups": [{"lr": _Boom(), "params": ["w"]}]}}, meta=None)
    # DCP wraps the weights-only unpickler's refusal in a CheckpointException (a BaseException, past
    # every `except Exception`): read as the refusal of a file is, naming the folder.
    message = (f"{folder}: refused to load: an entry of the folder pickles what mmssl does not allow (Trying to "
               "load unsupported GLOBAL {}.system whose module {} is blocked.); nothing of it was run")
    expected = {message.format(name, name) for name in ("posix", "os")}
    with pytest.raises(UnsafeCheckpointError) as err:
        read_checkpoint(str(folder))
    assert str(err.value) in expected
    with pytest.raises(UnsafeCheckpointError) as err:
        load_dcp(str(folder), {"optimizer_0": {"param_groups": [{"lr": 0.0, "params": []}]}})
    assert str(err.value) in expected
    assert not (tmp_path / "pwned").exists()


def test_a_folder_of_another_programs_dcp_save_without_weights_is_refused_naming_it(tmp_path):
    folder = _save(tmp_path / "other", {"model": {"w": torch.ones(2)}, "step": torch.tensor(3)}, meta=None)
    with pytest.raises(ValueError) as err:
        read_checkpoint(str(folder))
    assert str(err.value) == (f"{folder}: a sharded checkpoint folder without a state_dict entry (it holds "
                              "['model', 'step']): not a Lightning checkpoint's weights")

